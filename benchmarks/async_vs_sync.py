"""Wall-clock time to the same eval reward: the synchronous loop vs the asynchronous one (issue 5), one run each.

Same recipe, model, task and seed for both: algorithm async_reinforce (DIS loss, group-centred advantages) on the
arithmetic task with a dense reward (share of digit characters in the response), so a few steps of a small random
model measurably raise it. `sync` runs it through the synchronous loop (rollout → train → weight push, on-policy);
`async` through the asynchronous loop (rollout overlapped with training, --max-staleness, partial rollouts).

Eval is kept off the clock: every weight version the engines receive is recorded with the time it arrived, then
evaluated after both runs by the same in-process engine (held-out prompts, --eval-samples sampled responses each
at temperature 1 with fixed seeds: the expected reward, smoother than one greedy answer). The target is
`--target-frac` of the way from the initial reward to the best reward both modes reached; the time to it is
the arrival of the first version at or above it, counted from the start of each loop (after setup).

    python benchmarks/async_vs_sync.py --out benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

logger = logging.getLogger("async_vs_sync")


def recipe_dict(args: argparse.Namespace, run_dir: Path) -> dict:
    return {
        "model": {"preset": args.preset},
        "data": {"tasks": [{"kind": "arithmetic", "eval_size": args.eval_prompts,
                            "reward_fn": "benchmarks.async_vs_sync:digit_fraction"}],
                 "apply_chat_template": True, "max_prompt_length": 96},
        "rollout": {"n_samples_per_prompt": args.n_samples, "prompts_per_step": args.prompts_per_step,
                    "max_response_length": args.max_response_length},
        "algorithm": {"name": "async_reinforce", "max_staleness": args.max_staleness,
                      "partial_rollout": args.partial_rollout},
        "trainer": {"num_steps": args.steps, "learning_rate": args.lr, "micro_batch_tokens": 4096, "seed": args.seed},
        "logging": {"wandb_mode": "disabled", "run_dir": str(run_dir)},
    }


def digit_fraction(sample, response: str, answer, **metadata) -> float:
    """Share of the response's characters that are digits: dense, so a small random policy gets a signal."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def run_mode(args: argparse.Namespace, mode: str, root: Path) -> tuple[Path, list[tuple[float, int, dict]]]:
    """Train in `mode`; returns the run dir and [(seconds since the loop started, version, state dict)]."""
    from slime_dsa.config import load_recipe
    from slime_dsa.orchestrator.train import run_training

    versions: list[tuple[float, int, dict]] = []
    start: list[float] = []

    def on_weights(version: int, state: dict) -> None:
        now = time.perf_counter()
        if not start:
            start.append(now)  # the starting weights: the loop begins now
        versions.append((now - start[0], version, {k: v.clone() for k, v in state.items()}))

    path = root / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(args, root / mode)))
    t0 = time.perf_counter()
    run_dir = run_training(load_recipe(path), loop=mode, on_weights=on_weights)
    logger.info("%s: %d steps in %.1fs of loop (%.1fs with setup)", mode, args.steps, versions[-1][0],
                time.perf_counter() - t0)
    return run_dir, versions


def evaluate(args: argparse.Namespace, model_dir: Path, states: list[dict]) -> list[float]:
    """Mean reward on the held-out prompts for each state dict, sampled by one in-process engine."""
    from transformers import AutoTokenizer

    from rollout.engine import Engine, GenerateRequest, SamplingParams
    from slime_dsa.checkpoint import load_model
    from slime_dsa.config import RecipeConfig
    from slime_dsa.data.prompts import build_tasks

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    recipe = RecipeConfig.model_validate(recipe_dict(args, model_dir))
    (task,) = build_tasks(recipe.data, tokenizer)
    prompts = [p.prompt_ids for p in list(task.eval)]
    n = len(prompts) * args.eval_samples
    engine = Engine(load_model(model_dir, dtype=torch.float32).eval(), tokenizer=tokenizer,
                    max_cache_tokens=n * (96 + args.max_response_length) + 64, max_running_requests=n)
    rewards = []
    for state in states:
        engine.update_weights(state)
        for i, ids in enumerate(prompts):
            for j in range(args.eval_samples):
                sampling = SamplingParams(max_new_tokens=args.max_response_length, temperature=1.0,
                                          sampling_seed=1000 * i + j)
                engine.add_request(GenerateRequest(rid=f"{i}-{j}", input_ids=ids, sampling=sampling))
        total = 0.0
        while engine.num_running or engine.num_queued:
            for out in engine.step():
                if out.finish_reason is not None:
                    total += digit_fraction(None, tokenizer.decode(out.output_ids, skip_special_tokens=True), None)
        rewards.append(total / n)
    return rewards


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """Seconds until the first version whose eval reward reaches `target`; None if none does."""
    return next((t for t, r in curve if r >= target), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny", choices=["tiny", "quickstart"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--n-samples", type=int, default=4)
    parser.add_argument("--max-response-length", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--partial-rollout", default="retract", choices=["retract", "in_place", "off"])
    parser.add_argument("--eval-prompts", type=int, default=32)
    parser.add_argument("--eval-samples", type=int, default=4)
    parser.add_argument("--target-frac", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--modes", default="sync,async")
    parser.add_argument("--out", type=Path, help="append the result section to this markdown file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(1)

    import ray

    root = Path(tempfile.mkdtemp(prefix="async_vs_sync-"))
    curves: dict[str, list[tuple[float, float]]] = {}
    runs = {}
    loads: list[float] = []  # the machine is shared: its load during the loops goes into the report
    done = threading.Event()
    sampler = threading.Thread(target=_sample_load, args=(loads, done), daemon=True)
    sampler.start()
    try:
        for mode in args.modes.split(","):
            runs[mode] = run_mode(args, mode, root)
    finally:
        done.set()
        if ray.is_initialized():
            ray.shutdown()
    for mode, (run_dir, versions) in runs.items():
        rewards = evaluate(args, run_dir / "initial_model", [s for _, _, s in versions])
        curves[mode] = [(t, r) for (t, _, _), r in zip(versions, rewards)]
        logger.info("%s eval curve: %s", mode, " ".join(f"{t:.0f}s:{r:.3f}" for t, r in curves[mode]))

    base = curves[next(iter(curves))][0][1]
    best = min(max(r for _, r in c) for c in curves.values())
    target = base + args.target_frac * (best - base)
    times = {mode: time_to(c, target) for mode, c in curves.items()}
    ratio = times["sync"] / times["async"] if times.get("sync") and times.get("async") else None
    report = markdown(args, curves, runs, base, target, times, ratio, loads)
    print(report)
    if args.out:
        with args.out.open("a") as f:
            f.write("\n" + report)
    (root / "curves.json").write_text(json.dumps(curves))
    return 0


def _sample_load(loads: list[float], done: threading.Event) -> None:
    while not done.wait(2.0):
        loads.append(os.getloadavg()[0])


def step_medians(run_dir: Path) -> dict[str, float]:
    """Medians over steps 2..N of the loop's per-step timings (step 1 has nothing to overlap with)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    keys = {"step": "perf/step_time_s", "rollout": "perf/rollout_time_s", "gate/buffer wait": "perf/rollout_wait_s",
            "train": "perf/train_time_s", "weight push": "perf/sync_time_s", "staleness": "async/staleness_mean"}
    return {name: statistics.median(r[k] for r in records) for name, k in keys.items() if records and k in records[0]}


def markdown(args, curves, runs, base, target, times, ratio, loads) -> str:
    cmd = "python benchmarks/async_vs_sync.py " + shlex.join(sys.argv[1:])
    lines = [
        "### Async vs sync RL loop: wall-clock time to the same eval reward (CPU)",
        "",
        f"- date: {datetime.date.today().isoformat()}; hardware: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores (shared), load average {os.getloadavg()[0]:.1f} at the end; torch {torch.__version__}",
        f"- command: `{cmd}`",
        f"- recipe: `{args.preset}` preset from scratch, arithmetic prompts, reward = digit share of the response; "
        f"{args.prompts_per_step} prompts x {args.n_samples} samples/step, {args.max_response_length} new tokens, "
        f"lr {args.lr}, {args.steps} steps; 1 embedded engine + 1 FSDP rank (Ray actors, 1 CPU each); "
        f"async: max_staleness {args.max_staleness}, partial_rollout {args.partial_rollout}, engine and trainer "
        f"pinned to a core each (cluster.pin_cpus auto; the sync loop leaves them free)",
        f"- load average during the loops (1-min, sampled every 2 s): "
        + (f"{min(loads):.1f}-{max(loads):.1f}, mean {statistics.mean(loads):.1f}" if loads else "not sampled"),
        f"- eval (off the clock): {args.eval_prompts} held-out prompts x {args.eval_samples} samples at T=1; "
        f"initial {base:.3f}; target {target:.3f} = {args.target_frac:g} of the way to the best both reached",
        "",
        "| mode | loop time (s) | steps/s | best eval | time to target (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for mode, curve in curves.items():
        loop_s = curve[-1][0]
        t = times[mode]
        lines.append(f"| {mode} | {loop_s:.1f} | {args.steps / loop_s:.2f} | {max(r for _, r in curve):.3f} | "
                     f"{'not reached' if t is None else f'{t:.1f}'} |")
    lines.append("")
    lines.append("| mode | per-step medians (s), steps 2..N |")
    lines.append("|---|---|")
    for mode, (run_dir, _) in runs.items():
        lines.append(f"| {mode} | " + ", ".join(f"{k} {v:.3f}" for k, v in step_medians(run_dir).items()) + " |")
    lines.append("")
    lines.append("- per-step timings: neither loop recomputes pi_old (the DIS loss has none); async rollout is the "
                 "time between two batches (it overlaps training), gate/buffer wait the part of it the trainer waited")
    verdict = "not measurable" if ratio is None else f"{ratio:.2f}x -> {'reached' if ratio >= 1.5 else 'NOT reached'}"
    lines.append(f"- goal async >= 1.5x faster to the same reward: {verdict}")
    for mode, curve in curves.items():
        lines.append(f"- {mode} curve (s:reward): " + " ".join(f"{t:.0f}:{r:.3f}" for t, r in curve))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
