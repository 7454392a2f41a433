"""The trainer's host work in one RL train call: on CPU its time apart from the model's forward and backward.

On the H200 the train call of a 16 x 16 GRPO step with short answers is host-bound (issue 19): a few GPU
milliseconds of compute in ~0.2 s. On a CPU the model's forward and backward are real compute, so they are timed
apart (thread CPU time inside `token_logprobs_with_output` and `torch.autograd.backward`) and the rest of the call is
the trainer's own host work: batch preparation, shared-prompt packing, loss and metrics, gradient bookkeeping, the
optimiser step. Every figure is the calling thread's CPU time (time.thread_time), so other processes count less.
pre_forward_ms is the part before the model's first forward (its embedding: the call's first kernel on a GPU). On a CPU
it also pays for the previous call's memory (its first allocations fault pages the big forward and backward gave
back), so --pre-forward-calls N adds pre_forward_only_ms: the median over N calls ended at that forward, one after
another, which only the trainer's own work before the first kernel is in.

The call is `FSDPWorker.train_batches` as vs_trl.py's recipe makes it: GRPO in bypass mode (π_old = the rollout
log-probs; --recompute-old-logprobs for a π_old pass), groups of --group-size samples sharing a prompt, the whole
batch in one micro-batch, one rank, the bf16 compute copy (--no-mixed-precision: float32). --narrow keeps the
preset's structure (layers, experts, so the same parameter tensors and ops) at the tiny preset's widths.

Where torch sees a GPU the rank runs on it (as FSDPWorker does) and each call's wall time, from a synchronised start
to a synchronised end, is the figure to compare; host reads of cuda tensors are then the host syncs.

--baseline-tree runs the same measurement with another checkout's code (e.g. `git archive <commit>` unpacked) in
child processes alternating with this tree's, and reports the median of the per-round ratios.
--sync-sites lists, for one call, the ops that read a tensor on the host (`.item()`, `float()`, `.tolist()`,
`nonzero`, ...) by the source line that ran them: on a GPU those on device tensors are host syncs.

    python benchmarks/train_call_host_time.py --preset small --narrow --sync-sites
    python benchmarks/train_call_host_time.py --preset small --narrow --baseline-tree /tmp/base --rounds 5
    python benchmarks/train_call_host_time.py --preset small --narrow --samples 1024 --length 60 --prompt 40 \
        --pre-forward-calls 60 --baseline-tree /tmp/base --rounds 3  # 64 x 16, 40-token prompts, 20-token answers
    python benchmarks/train_call_host_time.py --preset small --narrow --grouped-experts --samples 64 --baseline-tree /tmp/base
    python benchmarks/train_call_host_time.py --preset small --baseline-tree /tmp/base --rounds 3 --sync-sites  # H200
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import logging
import math
import shutil
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch

import baseline_tree  # beside this script (sys.path[0]): a child on a baseline tree imports this tree's copy

logger = logging.getLogger("train_call_host_time")
clock = time.thread_time
# The tiny preset's widths: with --narrow a preset keeps its layers and experts (its parameter tensors and ops).
NARROW = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=2, q_lora_rank=32,
              kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_n_heads=4,
              index_head_dim=16)
# Ops that read a tensor's value on the host: a host sync on a device tensor.
HOST_READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
              "aten._unique2.default", "aten.unique_consecutive.default", "aten.unique_dim.default"}


class _FirstForward(Exception):
    """Ends a call at the model's first forward (--pre-forward-calls)."""


def grpo_batch(samples: int, length: int, prompt: int, group_size: int, vocab: int, seed: int = 0):
    """`samples` packed sequences of `length` tokens in groups of `group_size` sharing a `prompt`-token prompt."""
    from trainers.base import TrainBatch  # noqa: PLC0415

    g = torch.Generator().manual_seed(seed)
    ids = []
    for s in range(samples):
        if s % group_size == 0:
            shared = torch.randint(2, vocab, (prompt,), generator=g)
        ids.append(torch.cat([shared, torch.randint(2, vocab, (length - prompt,), generator=g)]))
    mask = torch.tensor(([0.0] * prompt + [1.0] * (length - prompt)) * samples)
    rollout = -torch.rand(samples * length, generator=g) * 3 * mask
    advantages = torch.randn(samples, generator=g).repeat_interleave(length)
    return TrainBatch(input_ids=torch.cat(ids), seqlens=[length] * samples, loss_mask=mask, rollout_logprobs=rollout,
                      advantages=advantages, prompt_lens=[prompt] * samples)


class _Clock:
    """Thread CPU time spent inside wrapped callables, by name."""

    def __init__(self) -> None:
        self.spent: collections.Counter = collections.Counter()
        self.depth = 0  # > 0 inside a wrapped callable (the model's forward or backward)

    def wrap(self, owner: object, name: str, key: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = clock()
            self.depth += 1
            try:
                return inner(*args, **kwargs)
            finally:
                self.depth -= 1
                self.spent[key] += clock() - start

        setattr(owner, name, timed)


def _site() -> str:
    """The three innermost frames outside torch and this file."""
    frames = [f for f in traceback.extract_stack()[:-2]
              if "/torch/" not in f.filename and Path(f.filename).name != Path(__file__).name]
    return " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[::-1][:3]) or "(this benchmark)"


def _host_read_sites(call, clocks: _Clock) -> tuple[int, int, collections.Counter]:
    """(aten ops dispatched, those outside the model's forward and backward, {(op, source line): count} of host
    reads) over one `call()`. `.tolist()` and `.cpu()`
    dispatch nothing on a CPU tensor, so they are counted by wrapping them."""
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops, self.outside, self.sites = 0, 0, collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            self.outside += clocks.depth == 0
            if str(func) in HOST_READS:
                self.sites[(str(func).split(".")[1], args[0].device.type, _site())] += 1
            return func(*args, **(kwargs or {}))

    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu")}

    def reading(name):
        def read(self, *args, **kwargs):
            count.sites[(name, self.device.type, _site())] += 1
            return originals[name](self, *args, **kwargs)
        return read

    with Count() as count:
        for name in originals:
            setattr(torch.Tensor, name, reading(name))
        try:
            call()
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
    return count.ops, count.outside, count.sites


def measure(args: argparse.Namespace) -> dict:
    """Build one rank and time `--calls` train calls of the batch after two warm-up calls."""
    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from slime_dsa.checkpoint.hf_format import build_model, save_pretrained  # noqa: PLC0415
    from slime_dsa.models.presets import preset_config  # noqa: PLC0415
    from trainers.base import OptimizerConfig, policy_config  # noqa: PLC0415
    from trainers.fsdp.worker import FSDPWorker  # noqa: PLC0415
    from trainers.process_group import free_port  # noqa: PLC0415

    torch.set_num_threads(1)
    if args.grouped_experts:
        from slime_dsa.models.glm_moe_dsa import Experts  # noqa: PLC0415

        Experts.use_grouped_mm = True
    config = preset_config(args.preset, vocab_size=args.vocab, eos_token_id=1, **(NARROW if args.narrow else {}))
    checkpoint = Path(tempfile.mkdtemp(prefix="train_call_")) / "model"
    save_pretrained(build_model(config, seed=0, dtype=torch.float32), checkpoint)
    loss = PPOLoss(eps_low=0.2, eps_high=0.28, bypass=not args.recompute_old_logprobs)
    tokens = args.samples * args.length
    rank = policy_config(str(checkpoint), loss, OptimizerConfig(learning_rate=1e-6, max_grad_norm=1.0),
                         mixed_precision=args.mixed_precision, micro_batch_tokens=tokens, seed=0)
    worker = FSDPWorker(0, 1, "127.0.0.1", free_port(), rank)
    batch = grpo_batch(args.samples, args.length, args.prompt, args.group_size, args.vocab)
    clocks = _Clock()
    clocks.wrap(type(worker.policy.runs), "token_logprobs_with_output", "model_forward")
    clocks.wrap(torch.autograd, "backward", "model_backward")
    first_forward: list[float] = []  # the clock at the call's first model forward (its first kernel on a GPU)
    stop_there = [False]

    def at_first_forward(*_) -> None:
        if not first_forward:
            first_forward.append(clock())
        if stop_there[0]:
            raise _FirstForward

    next(m for m in worker.policy.runs.modules() if isinstance(m, torch.nn.Embedding)).register_forward_pre_hook(
        at_first_forward)

    def call():
        shard = batch.select(list(range(args.samples)))  # what the group sends the one rank
        return worker.train_batches([shard], [(float(shard.loss_mask.sum()), args.samples)],
                                    args.recompute_old_logprobs, True)

    for _ in range(2):
        call()
    rows = []
    sync = torch.cuda.synchronize if worker.device.type == "cuda" else (lambda: None)
    for _ in range(args.calls):
        clocks.spent.clear()
        first_forward.clear()
        sync()
        start, wall = clock(), time.perf_counter()
        _, metrics = call()
        sync()
        total, wall = clock() - start, time.perf_counter() - wall
        model = clocks.spent["model_forward"] + clocks.spent["model_backward"]
        rows.append({"total_ms": 1e3 * total, "model_ms": 1e3 * model, "host_ms": 1e3 * (total - model),
                     "wall_ms": 1e3 * wall, "pre_forward_ms": 1e3 * (first_forward[0] - start)})
    out = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    out["calls"] = rows
    out["metrics"] = metrics[0]
    out["parameters"] = len(list(worker.policy.model.parameters()))
    out["device"] = torch.cuda.get_device_name() if worker.device.type == "cuda" else "cpu"
    digest = hashlib.sha256()
    for tensor in worker.policy.model.state_dict().values():  # the weights after every call's update, bit for bit
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    out["weights_sha256"] = digest.hexdigest()
    if args.sync_sites:
        out["aten_ops"], out["aten_ops_outside_model"], sites = _host_read_sites(call, clocks)
        out["host_reads"] = [[n, op, device, site] for (op, device, site), n in sites.most_common()]
    if args.pre_forward_calls:  # after the weights' digest: these calls end before any update
        stop_there[0], times = True, []
        for _ in range(args.pre_forward_calls):
            first_forward.clear()
            start = clock()
            try:
                call()
            except _FirstForward:
                times.append(1e3 * (first_forward[0] - start))
        out["pre_forward_only_ms"] = statistics.median(times)
    worker.shutdown()
    shutil.rmtree(checkpoint.parent, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--narrow", action="store_true", help="the preset's structure at the tiny preset's widths")
    parser.add_argument("--vocab", type=int, default=384, help="countdown's built-in tokenizer")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--length", type=int, default=100, help="tokens per sample")
    parser.add_argument("--prompt", type=int, default=80, help="prompt tokens per sample")
    parser.add_argument("--group-size", type=int, default=16, help="consecutive samples sharing a prompt")
    parser.add_argument("--no-mixed-precision", dest="mixed_precision", action="store_false",
                        help="float32 compute (default: the bf16 copy, as one GPU rank runs)")
    parser.add_argument("--recompute-old-logprobs", action="store_true", help="a π_old pass (default: bypass)")
    parser.add_argument("--calls", type=int, default=5, help="timed calls per process (after 2 warm-up calls)")
    parser.add_argument("--pre-forward-calls", type=int, default=0,
                        help="also time N calls ended at the model's first forward (pre_forward_only_ms)")
    parser.add_argument("--sync-sites", action="store_true", help="list the host reads of one call by source line")
    parser.add_argument("--grouped-experts", action="store_true",
                        help="the experts' grouped GEMM, as a GPU in bf16 runs them (CPU's bf16 default is the loop)")
    args = baseline_tree.parse(parser, argv)
    if baseline_tree.answered_as_child(args, measure):
        return
    if args.baseline_tree is None:
        result = {"this": measure(args)}
    else:
        rounds = []
        for r, pair in enumerate(baseline_tree.alternate(__file__, args.forward, args.baseline_tree, args.rounds)):
            pair["host_ratio"] = pair["this"]["host_ms"] / pair["baseline"]["host_ms"]
            pair["pre_forward_ratio"] = pair["this"]["pre_forward_ms"] / pair["baseline"]["pre_forward_ms"]
            if args.pre_forward_calls:
                pair["pre_forward_only_ratio"] = (pair["this"]["pre_forward_only_ms"]
                                                  / pair["baseline"]["pre_forward_only_ms"])
                logger.info("round %d: calls ended at the first forward, ms %.2f -> %.2f (%.2fx)", r + 1,
                            pair["baseline"]["pre_forward_only_ms"], pair["this"]["pre_forward_only_ms"],
                            pair["pre_forward_only_ratio"])
            pair["same_results"] = all(pair["this"][k] == pair["baseline"][k] for k in ("metrics", "weights_sha256"))
            pair["total_ratio"] = pair["this"]["total_ms"] / pair["baseline"]["total_ms"]
            pair["wall_ratio"] = pair["this"]["wall_ms"] / pair["baseline"]["wall_ms"]
            logger.info("round %d: host ms %.1f -> %.1f (%.2fx), before the first forward %.2f -> %.2f (%.2fx), "
                        "call CPU ms %.1f -> %.1f, wall ms %.1f -> %.1f",
                        r + 1, pair["baseline"]["host_ms"], pair["this"]["host_ms"], pair["host_ratio"],
                        pair["baseline"]["pre_forward_ms"], pair["this"]["pre_forward_ms"], pair["pre_forward_ratio"],
                        pair["baseline"]["total_ms"], pair["this"]["total_ms"], pair["baseline"]["wall_ms"],
                        pair["this"]["wall_ms"])
            rounds.append(pair)
        result = {"rounds": rounds, "same_results": all(p["same_results"] for p in rounds),
                  "host_ratio_median": statistics.median(p["host_ratio"] for p in rounds),
                  "pre_forward_ratio_median": statistics.median(p["pre_forward_ratio"] for p in rounds),
                  "total_ratio_median": statistics.median(p["total_ratio"] for p in rounds),
                  "wall_ratio_median": statistics.median(p["wall_ratio"] for p in rounds)}
        if args.pre_forward_calls:
            result["pre_forward_only_ratio_median"] = statistics.median(p["pre_forward_only_ratio"] for p in rounds)
    result["args"] = {k: v for k, v in vars(args).items() if k != "forward"}
    report(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


def report(result: dict) -> None:
    """Log the summary (and the host-read sites of the last measurement that has them)."""
    if "rounds" in result:
        for side in ("baseline", "this"):
            logger.info("%s: host ms per call %s, before the first forward %s (median of each process's calls)", side,
                        [round(p[side]["host_ms"], 1) for p in result["rounds"]],
                        [round(p[side]["pre_forward_ms"], 2) for p in result["rounds"]])
        logger.info("before the first forward this/baseline, median of rounds: %.3f; calls ended there: %.3f",
                    result["pre_forward_ratio_median"], result.get("pre_forward_only_ratio_median", math.nan))
        logger.info("host work this/baseline, median of rounds: %.3f; whole call (CPU time): %.3f, (wall): %.3f; "
                    "metrics and weights after every call bit-equal to the baseline's: %s", result["host_ratio_median"],
                    result["total_ratio_median"], result["wall_ratio_median"], result["same_results"])
        last = result["rounds"][-1]
        measured = [("baseline", last["baseline"]), ("this", last["this"])]
    else:
        measured = [("this", result["this"])]
    for side, m in measured:
        logger.info("%s (%s): call %.1f ms CPU, %.1f ms wall; model fwd+bwd %.1f ms, host %.1f ms (%.2f ms before the "
                    "first forward); %d parameter tensors; metrics %s", side, m["device"], m["total_ms"], m["wall_ms"],
                    m["model_ms"], m["host_ms"], m["pre_forward_ms"],
                    m["parameters"],
                    {k: round(v, 6) for k, v in m["metrics"].items()})
        if "host_reads" in m:
            logger.info("%s: %d aten ops, %d outside the model's forward and backward; host reads by site:\n%s",
                        side, m["aten_ops"], m["aten_ops_outside_model"],
                        "\n".join(f"  {n:5d} {op:22s} {device:5s} {site}" for n, op, device, site in m["host_reads"]))


if __name__ == "__main__":
    main()
