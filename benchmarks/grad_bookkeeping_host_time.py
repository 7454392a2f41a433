"""Host time of one optimiser step's gradient bookkeeping on the bf16 copy path, apart from the model.

Per step: `Bf16Compute.zero_grad`, one micro-batch's `accumulate_gradients` (the copy's bf16 gradients are
put in place beforehand, as a backward leaves them) and the clip to norm 1 (the copy's `clip_grad_norm` where its tree
has one, else torch's `clip_grad_norm_`), for this tree's copy and, with --baseline-tree, another checkout's (its
bf16_compute.py and grad_sums.py), alternating in one process on the same model; then fused AdamW's step split into its per-parameter
Python (`_init_group`) and the rest. The model is a preset's structure (--narrow: the tiny preset's widths, as in
train_call_host_time.py), so the parameter tensors are the same ones the trainer walks.

    python benchmarks/grad_bookkeeping_host_time.py --preset small --narrow --baseline-tree /tmp/base636
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline_tree import module_of  # noqa: E402  (beside this script)

logger = logging.getLogger("grad_bookkeeping_host_time")


def copy_class(tree: str | None) -> type:
    """Bf16Compute from this tree, or from `tree`'s trainers/fsdp/bf16_compute.py with that tree's gradient sums."""
    copy = module_of(tree, "trainers/fsdp/bf16_compute.py", "trainers.fsdp.bf16_compute")
    if tree is not None:
        copy.add_gradients = module_of(tree, "trainers/grad_sums.py", "trainers.grad_sums").add_gradients
    return copy.Bf16Compute


def _gradient_holders(copy) -> list[torch.Tensor]:
    """The tensors a backward through the copy accumulates gradients into: its trainable parameters, and the
    stacked expert leaves where a tree's copy has them (its per-expert parameters then do not train)."""
    from slime_dsa.models.glm_moe_dsa import Experts  # noqa: PLC0415

    leaves = [leaf for m in copy.module.modules() if isinstance(m, Experts) and m.leaves for leaf in m.leaves]
    return [p for p in copy.module.parameters() if p.requires_grad] + [leaf for leaf in leaves if leaf.requires_grad]


def _clip(copy, trainable: list[torch.Tensor]) -> None:
    """The copy's clip where its tree has one (and it takes these parameters), else torch's."""
    clip = getattr(copy, "clip_grad_norm", None)
    if clip is None or clip(trainable, 1.0) is None:
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)


def _median_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--narrow", action="store_true", help="the preset's structure at the tiny preset's widths")
    parser.add_argument("--baseline-tree", default=None, help="another checkout's bf16_compute.py to compare with")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="alternating measurements of each tree")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from benchmarks.train_call_host_time import NARROW  # noqa: PLC0415
    from slime_dsa.checkpoint.hf_format import build_model  # noqa: PLC0415
    from slime_dsa.models.presets import preset_config  # noqa: PLC0415
    from trainers.optim import build_optimizer  # noqa: PLC0415

    torch.set_num_threads(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    config = preset_config(args.preset, vocab_size=384, eos_token_id=1, **(NARROW if args.narrow else {}))
    master = build_model(config, seed=0, dtype=torch.float32).to(device)
    trees = {"this tree": None} | ({"baseline": args.baseline_tree} if args.baseline_tree else {})
    copies = {name: copy_class(tree)(master) for name, tree in trees.items()}
    holders = {id(copy): _gradient_holders(copy) for copy in copies.values()}
    grads = {id(copy): [torch.randn_like(h) for h in holders[id(copy)]] for copy in copies.values()}
    trainable = [p for p in master.parameters() if p.requires_grad]
    logger.info("%d parameter tensors on %s; gradients a backward leaves: %s", len(trainable), device,
                {name: len(holders[id(copy)]) for name, copy in copies.items()})

    def step(copy) -> None:
        copy.zero_grad()
        put_only(copy)  # what a backward leaves (outside the timing below: subtracted)
        copy.accumulate_gradients()
        _clip(copy, trainable)

    def put_only(copy) -> None:
        for c, g in zip(holders[id(copy)], grads[id(copy)]):
            c.grad = g

    figures = {name: [] for name in copies}
    for _ in range(args.rounds):
        for name, copy in copies.items():
            step(copy)
            sync()
            spent = _median_ms(lambda: (step(copy), sync()), args.steps)
            figures[name].append(spent - _median_ms(lambda: put_only(copy), args.steps))
    for name, values in figures.items():
        logger.info("zero_grad + accumulate_gradients + clip, %s: %s ms a step (median %.3f)", name,
                    ", ".join(f"{v:.3f}" for v in values), statistics.median(values))
    if args.baseline_tree:
        ratios = [a / b for a, b in zip(figures["this tree"], figures["baseline"])]
        logger.info("this tree / baseline: median %.2f (%.2f-%.2f)", statistics.median(ratios), min(ratios), max(ratios))

    copy = copies["this tree"]
    step(copy)
    optimizer = build_optimizer(master, 1e-6, 0.1, (0.9, 0.999), fused=True)
    optimizer.step()
    sync()
    whole = _median_ms(lambda: (optimizer.step(), sync()), args.steps)
    init = _median_ms(lambda: [optimizer._init_group(g, [], [], [], [], [], []) for g in optimizer.param_groups], args.steps)
    logger.info("fused AdamW step: %.3f ms, of which _init_group (per-parameter Python, %d groups): %.3f ms",
                whole, len(optimizer.param_groups), init)


if __name__ == "__main__":
    main()
