"""Offline check of OPD's training signal, without Ray or engines: sample from the student (temperature 1), take
the advantage log pT - log pS per token (detached), step Adam on -mean(A * log pS), and log the sampled reverse KL
to the teacher before each update and on the same batch after it.

    python benchmarks/opd_signal_check.py --root runs/opd_merge --domain countdown --lr 5e-4 --steps 15
"""
import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformers import AutoTokenizer  # noqa: E402

from slime_dsa.checkpoint import load_model, save_pretrained  # noqa: E402
from slime_dsa.config import load_recipe  # noqa: E402
from slime_dsa.data.prompts import build_tasks  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--root", default="runs/opd_merge", help="benchmarks/opd_merge.py's --root (student, experts)")
parser.add_argument("--domain", default="countdown")
parser.add_argument("--lr", type=float, default=5e-4)
parser.add_argument("--steps", type=int, default=15)
parser.add_argument("--samples", type=int, default=48, help="prompts a step, one sample each")
parser.add_argument("--save", help="write the student after the last update here (for benchmarks/opd_kl_eval.py)")
args = parser.parse_args()
logging.basicConfig(level=logging.INFO, format="%(message)s")
logger = logging.getLogger("opd_signal_check")
torch.manual_seed(0)
torch.set_num_threads(1)
root, domain, lr, steps, n = args.root, args.domain, args.lr, args.steps, args.samples
tok = AutoTokenizer.from_pretrained(f"{root}/student/model")
cfg = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "opd_domains.yaml", [])
cfg.data.tasks = [t for t in cfg.data.tasks if t.name == domain]
task = build_tasks(cfg.data, tok, train_size=2000)[0]
student = load_model(f"{root}/student/model", dtype=torch.float32)
teacher = load_model(f"{root}/experts/{domain}/model", dtype=torch.float32).eval()
opt = torch.optim.Adam(student.parameters(), lr=lr)
eos, maxlen = tok.eos_token_id, 24

def logprobs(model, seqs, plen):
    out = []
    for s, p in zip(seqs, plen):
        lp = torch.log_softmax(model(torch.tensor(s)).logits.float(), -1)
        out.append(lp[p - 1:-1].gather(1, torch.tensor(s[p:])[:, None])[:, 0])
    return out

for step in range(steps):
    prompts = [task.train[(step * n + i) % len(task.train)].prompt_ids for i in range(n)]
    seqs = []
    with torch.no_grad():
        for p in prompts:
            s = list(p)
            for _ in range(maxlen):
                nxt = int(torch.multinomial(torch.softmax(student(torch.tensor(s)).logits[-1].float(), -1), 1))
                s.append(nxt)
                if nxt == eos: break
            seqs.append(s)
    plen = [len(p) for p in prompts]
    with torch.no_grad():
        lt = logprobs(teacher, seqs, plen)
    ls = logprobs(student, seqs, plen)
    adv = [(t - s.detach()) for t, s in zip(lt, ls)]
    kl = torch.cat([-a for a in adv]).mean().item()
    loss = -torch.cat([a * s for a, s in zip(adv, ls)]).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    with torch.no_grad():
        after = torch.cat([t - s for t, s in zip(lt, logprobs(student, seqs, plen))]).mean().item()
    logger.info("step %d: sampled reverse KL %.3f, the same batch after the update %.3f", step, kl, -after)
if args.save:
    save_pretrained(student, args.save)
    tok.save_pretrained(args.save)
