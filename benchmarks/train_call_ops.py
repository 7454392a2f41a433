"""The aten ops one RL train call dispatches, by module kind and phase: a CPU proxy for the GPU's kernel launches.

On the H200 a short-answer train call is host-bound (issue 19): each op costs a launch's host time, so fewer ops is
less host time. One call as train_call_host_time.py makes it (GRPO bypass, one rank, the bf16 compute copy, the
experts' grouped GEMM as a GPU runs them) is counted under a TorchDispatchMode. Forward ops are attributed to the
innermost module kind running (module hooks, plus wrapped RoPE, log-prob and optimizer functions); backward ops to
the kind whose forward made the autograd node running them. On a CPU the attention and indexer run torch reference
ops where a GPU runs Triton kernels, so those two rows are not a launch count.

The call's CPU time is timed apart from the counting; with --baseline-tree both trees run in child processes, in
alternating rounds, and the ratio this / baseline of each round's median call time is reported.

    python benchmarks/train_call_ops.py --preset small
    python benchmarks/train_call_ops.py --preset 300m --baseline-tree /tmp/base --rounds 5
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import baseline_tree  # beside this script
from train_call_host_time import NARROW, grpo_batch

# The 300m shape of benchmarks/engine_throughput.py (tests/test_true_on_policy_300m.py), over the small preset.
# indexer_types None: ModelConfig's default pattern, as there.
PRESET_300M = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, indexer_types=None, n_group=1,
                   topk_group=1)
KINDS = {"MLAttention": "attention", "Indexer": "indexer", "Router": "moe routing", "Experts": "moe experts",
         "MoE": "moe (shared expert, sum)", "MLP": "dense mlp", "RMSNorm": "norm", "LayerNorm": "norm",
         "Embedding": "embedding", "DecoderLayer": "residual adds"}
LEAF = "grad accumulation"
# Ops that launch no kernel on a GPU besides views (func.is_view): reshapes of a fresh copy, allocations.
NO_KERNEL = {"aten._unsafe_view.default", "aten.empty.memory_format", "aten.empty_like.default",
             "aten.new_empty.default", "aten.empty_strided.default"}


class _Kinds:
    """The kind of code running now (a stack), and each layer's index: set by module hooks and wrapped functions."""

    def __init__(self) -> None:
        self.stack: list[str] = ["trainer"]
        self.layer: list[int | None] = [None]

    def push(self, kind: str, layer: int | None = None) -> None:
        if kind == "norm" and self.stack[-1] in ("indexer", "moe routing"):
            kind = self.stack[-1]  # the indexer's key norm counts as the indexer's
        self.stack.append(kind)
        self.layer.append(self.layer[-1] if layer is None else layer)

    def pop(self) -> None:
        self.stack.pop()
        self.layer.pop()

    def wrap(self, owner: object, name: str, kind: str) -> None:
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def wrapped(*args, **kwargs):
            self.push(kind)
            try:
                return inner(*args, **kwargs)
            finally:
                self.pop()

        setattr(owner, name, wrapped)


class _Tag(TorchFunctionMode):
    """Tags the autograd nodes each forward call makes with the kind and layer running (so backward ops find it)."""

    def __init__(self, kinds: _Kinds) -> None:
        super().__init__()
        self.kinds = kinds

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        todo = [t.grad_fn for t in (out if isinstance(out, (tuple, list)) else [out])
                if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while todo:  # the new nodes: those not tagged yet, back to the inputs' nodes
            node = todo.pop()
            if node is None or "kind" in node.metadata:
                continue
            node.metadata["kind"] = (self.kinds.stack[-1], self.kinds.layer[-1])
            todo += [n for n, _ in node.next_functions]
        return out


class _Count(TorchDispatchMode):
    """Counts aten ops by (phase, kind, layer, op)."""

    def __init__(self, kinds: _Kinds) -> None:
        super().__init__()
        self.kinds = kinds
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        node = torch._C._current_autograd_node()
        if node is None:
            key = ("forward" if self.kinds.stack[-1] != "optimizer" else "optimizer", self.kinds.stack[-1],
                   self.kinds.layer[-1])
        elif "AccumulateGrad" in node.name():
            key = ("backward", LEAF, None)
        else:
            key = ("backward", *node.metadata.get("kind", ("trainer", None)))
        self.ops[(*key, str(func), not func.is_view and str(func) not in NO_KERNEL)] += 1
        return func(*args, **(kwargs or {}))


def _model_config(args: argparse.Namespace):
    from slime_dsa.models.presets import preset_config  # noqa: PLC0415

    overrides = {**(PRESET_300M if args.preset == "300m" else {}), **(NARROW if args.narrow else {})}
    return preset_config("small" if args.preset == "300m" else args.preset, vocab_size=args.vocab, eos_token_id=1,
                         **overrides)


def measure(args: argparse.Namespace) -> dict:
    """Build one rank; time --calls train calls after two warm-up calls, then count one call's ops."""
    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from slime_dsa.checkpoint.hf_format import build_model, save_pretrained  # noqa: PLC0415
    from slime_dsa.models import glm_moe_dsa  # noqa: PLC0415
    from trainers.base import OptimizerConfig, policy_config  # noqa: PLC0415
    from trainers.fsdp.worker import FSDPWorker  # noqa: PLC0415
    from trainers.process_group import free_port  # noqa: PLC0415

    torch.set_num_threads(1)
    glm_moe_dsa.Experts.use_grouped_mm = args.grouped_experts
    config = _model_config(args)
    checkpoint = Path(tempfile.mkdtemp(prefix="train_call_ops_")) / "model"
    save_pretrained(build_model(config, seed=0, dtype=torch.float32), checkpoint)
    rank = policy_config(str(checkpoint), PPOLoss(eps_low=0.2, eps_high=0.28, bypass=True),
                         OptimizerConfig(learning_rate=1e-6, max_grad_norm=1.0), mixed_precision=True,
                         micro_batch_tokens=args.samples * args.length, seed=0)
    worker = FSDPWorker(0, 1, "127.0.0.1", free_port(), rank)
    batch = grpo_batch(args.samples, args.length, args.prompt, args.group_size, args.vocab)

    def call():
        shard = batch.select(list(range(args.samples)))
        return worker.train_batches([shard], [(float(shard.loss_mask.sum()), args.samples)], False, True)

    for _ in range(2):
        call()
    times = []
    for _ in range(args.calls):
        start = time.thread_time()
        _, metrics = call()
        times.append(1e3 * (time.thread_time() - start))

    kinds = _Kinds()
    for name, kind in (("apply_interleaved_rope", "rope"), ("rope_cos_sin", "rope"),
                       ("chunked_logprobs", "log-prob")):
        kinds.wrap(glm_moe_dsa, name, kind)
    kinds.wrap(worker, "apply_gradients", "optimizer")
    kinds.wrap(glm_moe_dsa.Indexer, "project", "indexer")
    kinds.wrap(glm_moe_dsa.ops, "indexer_topk", "indexer top-k (GPU: Triton)")
    kinds.wrap(glm_moe_dsa.ops, "sparse_mla_attention", "sparse attention (GPU: Triton)")
    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(
                 lambda m, _: kinds.push(KINDS.get(type(m).__name__, kinds.stack[-1]), _layer_of(m))),
             torch.nn.modules.module.register_module_forward_hook(lambda m, _, __: kinds.pop())]
    try:
        with _Tag(kinds), _Count(kinds) as count:
            call()
    finally:
        for hook in hooks:
            hook.remove()
    worker.shutdown()
    shutil.rmtree(checkpoint.parent, ignore_errors=True)
    return {"call_ms": statistics.median(times), "metrics": metrics[0],
            "ops": [[*key, n] for key, n in sorted(count.ops.items(), key=str)]}


def _layer_of(module: torch.nn.Module) -> int | None:
    attn = getattr(module, "self_attn", None)
    return attn.layer_idx if attn is not None else None


def tables(results: dict[str, dict]) -> str:
    """Markdown: ops per call by kind and phase, and by layer, one column per tree; each cell "ops (of which
    would launch a kernel on a GPU: not views)"."""
    sides = list(results)
    by_kind = {side: collections.Counter() for side in sides}
    by_layer = {side: collections.Counter() for side in sides}
    for side, result in results.items():
        for phase, kind, layer, _, kernel, n in result["ops"]:
            for counter, key in ((by_kind, (kind, phase)), (by_kind, (kind, "total")), (by_kind, ("all", phase)),
                                 (by_kind, ("all", "total")), (by_layer, ("layer" if layer is None else layer, phase))):
                counter[side][key] += n
                counter[side][(*key, "kernels")] += n * kernel
    phases = ("forward", "backward", "optimizer", "total")
    head = "| kind | " + " | ".join(f"{p} ({s})" for p in phases for s in sides) + " |"
    lines = [head, "|" + "---|" * (1 + len(phases) * len(sides))]
    kinds = sorted({k[0] for side in sides for k in by_kind[side]} - {"all"},
                   key=lambda k: -max(by_kind[s][(k, "total")] for s in sides))
    for kind in [*kinds, "all"]:
        lines.append(f"| {kind} | " + " | ".join(_cell(by_kind[s], (kind, p)) for p in phases for s in sides) + " |")
    layers = sorted({k[0] for side in sides for k in by_layer[side]}, key=lambda k: (isinstance(k, str), str(k).zfill(3)))
    lines += ["", "| layer | " + " | ".join(f"{p} ({s})" for p in ("forward", "backward") for s in sides) + " |",
              "|" + "---|" * (1 + 2 * len(sides))]
    for layer in layers:
        name = "outside layers" if layer == "layer" else layer
        lines.append(f"| {name} | " + " | ".join(_cell(by_layer[s], (layer, p)) for p in ("forward", "backward")
                                                  for s in sides) + " |")
    return "\n".join(lines)


def _cell(counts: collections.Counter, key: tuple) -> str:
    return f"{counts[key]} ({counts[(*key, 'kernels')]})"


def top_ops(result: dict, n: int) -> str:
    """The n most dispatched kernel ops of each kind (forward and backward apart), for finding what to cut."""
    per = collections.defaultdict(collections.Counter)
    for phase, kind, _, op, kernel, count in result["ops"]:
        if kernel:
            per[(kind, phase)][op] += count
    return "\n".join(f"{kind} {phase}: " + ", ".join(f"{op.removeprefix('aten.')} {c}" for op, c in ops.most_common(n))
                     for (kind, phase), ops in sorted(per.items()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small", help="a models/presets.py preset or 300m")
    parser.add_argument("--wide", dest="narrow", action="store_false",
                        help="the preset's own widths (default: its layers and experts at the tiny preset's widths)")
    parser.add_argument("--vocab", type=int, default=384, help="countdown's built-in tokenizer")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--length", type=int, default=40, help="tokens per sample")
    parser.add_argument("--prompt", type=int, default=30, help="prompt tokens per sample")
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--calls", type=int, default=5, help="timed calls per process (after 2 warm-up calls)")
    parser.add_argument("--top", type=int, default=0, help="also list each kind's N most dispatched ops")
    parser.add_argument("--loop-experts", dest="grouped_experts", action="store_false",
                        help="the experts' per-expert loop (default: the grouped GEMM a GPU runs)")
    args = baseline_tree.parse(parser, argv)
    if baseline_tree.answered_as_child(args, measure):
        return
    if args.baseline_tree is None:
        this = baseline_tree.child_result(__file__, args.forward, baseline_tree.THIS_TREE)
        print(f"one train call, preset {args.preset}: {this['call_ms']:.1f} ms CPU\n\n" + tables({"this": this}))
        if args.top:
            print("\n" + top_ops(this, args.top))
        result = {"this": this}
    else:
        rounds = baseline_tree.alternate(__file__, args.forward, args.baseline_tree, args.rounds)
        ratios = [r["this"]["call_ms"] / r["baseline"]["call_ms"] for r in rounds]
        same = all(r["this"]["metrics"] == r["baseline"]["metrics"] for r in rounds)
        print(f"one train call, preset {args.preset}: CPU ms baseline {[round(r['baseline']['call_ms'], 1) for r in rounds]}"
              f", this {[round(r['this']['call_ms'], 1) for r in rounds]}; this / baseline median "
              f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}); metrics bit-equal: {same}\n\n"
              + tables({"base": rounds[-1]["baseline"], "this": rounds[-1]["this"]}))
        result = {"rounds": rounds, "ratio_median": statistics.median(ratios), "same_metrics": same}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
