"""Reverse KL(student ‖ teacher) of saved students on one domain's held-out prompts, exact over the vocabulary at each
position of the student's own samples (temperature 1, a fixed seed per model), so that checkpoints of an OPD run (or
of benchmarks/opd_signal_check.py) compare with far less noise than the rollouts' sampled estimate.

    python benchmarks/opd_kl_eval.py --root runs/opd_merge --domain countdown runs/x/checkpoints/step_*

Prints, per model: the exact reverse KL per token, the sampled estimate (log π_S − log π_T of the sampled tokens),
the teacher's mean log-prob of the samples, and the student's mean response length.
"""
import argparse
import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformers import AutoTokenizer  # noqa: E402

from slime_dsa.checkpoint import load_model  # noqa: E402
from slime_dsa.config import load_recipe  # noqa: E402
from slime_dsa.data.prompts import build_tasks  # noqa: E402

logger = logging.getLogger("opd_kl_eval")


def domain_prompts(root: str, domain: str, n: int) -> tuple[list[list[int]], int]:
    """The first n held-out prompts of `domain` (recipes/opd_domains.yaml) and the tokenizer's eos id."""
    tok = AutoTokenizer.from_pretrained(f"{root}/student/model")
    cfg = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "opd_domains.yaml", [])
    cfg.data.tasks = [t for t in cfg.data.tasks if t.name == domain]
    task = build_tasks(cfg.data, tok, train_size=2000)[0]
    return [list(task.eval[i].prompt_ids) for i in range(min(n, len(task.eval)))], tok.eos_token_id


@torch.no_grad()
def sample(model, prompt: list[int], eos: int, max_len: int, gen: torch.Generator) -> list[int]:
    seq = list(prompt)
    for _ in range(max_len):
        probs = torch.softmax(model(torch.tensor(seq)).logits[-1].float(), -1)
        nxt = int(torch.multinomial(probs, 1, generator=gen))
        seq.append(nxt)
        if nxt == eos:
            break
    return seq


@torch.no_grad()
def kl_of(student, teacher, prompts: list[list[int]], eos: int, max_len: int, samples: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    exact = sampled = teacher_lp = 0.0
    tokens = 0
    for prompt in prompts:
        for _ in range(samples):
            seq = sample(student, prompt, eos, max_len, gen)
            p = len(prompt)
            ids = torch.tensor(seq)
            ls = torch.log_softmax(student(ids).logits.float(), -1)[p - 1:-1]
            lt = torch.log_softmax(teacher(ids).logits.float(), -1)[p - 1:-1]
            y = ids[p:, None]
            exact += float((ls.exp() * (ls - lt)).sum())
            s_y, t_y = ls.gather(1, y)[:, 0], lt.gather(1, y)[:, 0]
            sampled += float((s_y - t_y).sum())
            teacher_lp += float(t_y.sum())
            tokens += len(seq) - p
    n = max(tokens, 1)
    return {"exact_reverse_kl": exact / n, "sampled_reverse_kl": sampled / n, "teacher_logprob": teacher_lp / n,
            "response_len": tokens / (len(prompts) * samples)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="*", help="student model or checkpoint directories (default: ROOT/student/model)")
    parser.add_argument("--root", default="runs/opd_merge", help="benchmarks/opd_merge.py's --root (student, experts)")
    parser.add_argument("--domain", default="countdown")
    parser.add_argument("--prompts", type=int, default=64, help="held-out prompts")
    parser.add_argument("--samples", type=int, default=2, help="samples per prompt")
    parser.add_argument("--max-len", type=int, default=24, help="response tokens at most (rollout.max_response_length)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="append one JSON line per model here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    prompts, eos = domain_prompts(args.root, args.domain, args.prompts)
    teacher = load_model(f"{args.root}/experts/{args.domain}/model", dtype=torch.float32).eval()
    for path in args.models or [f"{args.root}/student/model"]:
        student = load_model(path, dtype=torch.float32).eval()
        row = {"model": str(path), "domain": args.domain,
               **kl_of(student, teacher, prompts, eos, args.max_len, args.samples, args.seed)}
        logger.info("%s: exact reverse KL %.4f, sampled %.4f, teacher log-prob %.3f, length %.1f", path,
                    row["exact_reverse_kl"], row["sampled_reverse_kl"], row["teacher_logprob"], row["response_len"])
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
