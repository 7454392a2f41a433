"""The experts' weight stacking in a training forward and backward: one stack of every gate and up projection
(this tree's `Experts._stack`) against a cat per expert and then a stack (the rule before, written here as the
baseline), alternating in one process on one MoE layer of a preset.

Per call: the grouped experts' forward over --tokens tokens (random routing, top-k of the preset) and the backward of
its sum, timed on the calling thread's CPU clock (time.thread_time). --narrow keeps the preset's experts at the tiny
preset's widths, so the host work of the ops and autograd nodes shows rather than the matmuls'. Also counted once
per side: the aten ops the forward runs and the autograd nodes of its graph.

    PYTHONPATH=$PWD python benchmarks/expert_stack_host_time.py --preset small --narrow --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline_tree import ratio_in_turn, time_in_turn  # noqa: E402  (beside this script)
from copy_micro_batch_host_time import graph_counts  # noqa: E402
from train_call_host_time import NARROW  # noqa: E402

from slime_dsa.checkpoint.hf_format import build_model  # noqa: E402
from slime_dsa.models.glm_moe_dsa import Experts  # noqa: E402
from slime_dsa.models.presets import preset_config  # noqa: E402


def cat_then_stack(experts: Experts) -> tuple[torch.Tensor, torch.Tensor]:
    """The baseline: each expert's [gate; up] by a cat, then a stack of those."""
    gate_up = [torch.cat([m.gate_proj.weight, m.up_proj.weight]) for m in experts]
    return torch.stack(gate_up), torch.stack([m.down_proj.weight for m in experts])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--narrow", action="store_true", help="the preset's experts at the tiny preset's widths")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=20, help="timed calls per side per round")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = preset_config(args.preset, vocab_size=384, eos_token_id=1, **(NARROW if args.narrow else {}))
    model = build_model(config, seed=0, dtype=torch.float32)
    experts = next(m for m in model.modules() if isinstance(m, Experts))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, config.hidden_size, generator=g, requires_grad=True)
    expert_ids = torch.stack([torch.randperm(len(experts), generator=g)[:config.num_experts_per_tok]
                              for _ in range(args.tokens)])
    weights = torch.rand(args.tokens, config.num_experts_per_tok, generator=g)
    sides = {"one stack (this tree)": Experts._stack, "cat per expert + stack (before)": cat_then_stack}

    def call() -> torch.Tensor:
        out = experts._forward_grouped(x, weights, expert_ids)
        out.sum().backward()
        return out

    counts: dict[str, tuple[int, int]] = {}
    outputs = {}
    for side, stack in sides.items():
        Experts._stack = stack
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = experts._forward_grouped(x, weights, expert_ids)
        counts[side] = (sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None),
                        graph_counts(out)[0])
        outputs[side] = out.detach()
    times = time_in_turn({side: lambda stack=stack: (setattr(Experts, "_stack", stack), call())
                          for side, stack in sides.items()}, args.rounds, args.calls, warm_up=True)
    Experts._stack = sides["one stack (this tree)"]
    equal = torch.equal(*outputs.values())
    result = {side: statistics.median(v) for side, v in times.items()}
    ratio, low, high = ratio_in_turn(times, "one stack (this tree)", "cat per expert + stack (before)")
    print(f"{len(experts)} experts, {args.tokens} tokens, forward + backward, thread CPU ms a call (median of "
          f"{args.rounds} rounds); aten ops in the forward; autograd nodes; outputs equal: {equal}")
    for side in sides:
        print(f"  {side}: {result[side]:.3f} ms ({', '.join(f'{v:.2f}' for v in times[side])}); "
              f"{counts[side][0]} ops, {counts[side][1]} nodes")
    print(f"  this tree / before: median {ratio:.2f} ({low:.2f}-{high:.2f})")
    return {"ms": result, "counts": counts, "ratio": ratio, "equal": equal}


if __name__ == "__main__":
    main()
