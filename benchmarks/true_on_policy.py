"""True on-policy (issue 23): RL step time with model.true_on_policy on against off, and how many tokens agree.

The same recipe runs twice in one process through the real loop (Ray, engines, trainers, weight syncs): switch off,
then on. For each it reads metrics.jsonl: the median `perf/step_time_s` (step 1, with its warm-up, left out), the mean
`train/train_rollout_logprob_exact_frac` (the share of generated tokens whose engine log-prob equals the trainer's bit
for bit), the largest `train/train_rollout_logprob_abs_diff_max`, and the largest PPO-KL (`train/approx_kl`) and
IcePop masked fraction (`train/icepop_mask_frac`) of any step, which true on-policy makes exactly 0. The figure of merit is the step-time ratio
on / off (issue 23's goal on the H200: at most 1.3).

    python benchmarks/true_on_policy.py --device cpu --preset tiny --steps 6
    python benchmarks/true_on_policy.py --device cpu --recipe recipes/quickstart.yaml --steps 6
    python benchmarks/true_on_policy.py --device cuda --recipe recipes/gpu_single.yaml --steps 20   # once GPU is allowed

A timing is a ratio within one run of this script: the machine's load moves both modes alike only when they run
close together (--rounds alternates off/on that many times).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

logger = logging.getLogger("true_on_policy")


def recipe_dict(args: argparse.Namespace, on: bool, run_dir: Path) -> dict:
    """The recipe of one run: --recipe (or a from-scratch GRPO recipe of --preset) with the switch set."""
    if args.recipe:
        recipe = {"defaults": str(Path(args.recipe).resolve())}
    else:
        recipe = {
            "model": {"preset": args.preset},
            "data": {"tasks": [{"kind": "arithmetic", "task_args": {"max_digits": 2}}], "apply_chat_template": True,
                     "max_prompt_length": 64},
            "rollout": {"n_samples_per_prompt": 4, "prompts_per_step": 8, "max_response_length": 24,
                        "temperature": 1.0},
            "algorithm": {"name": "grpo", "use_rollout_logprobs": True},
            "trainer": {"num_workers": 1, "learning_rate": 1e-3, "micro_batch_tokens": 4096},
        }
    recipe.setdefault("model", {})["true_on_policy"] = on
    recipe.setdefault("trainer", {})["num_steps"] = args.steps
    recipe["logging"] = {"wandb_mode": "disabled", "run_dir": str(run_dir), "eval_every": 0}
    recipe["checkpoint"] = {"save_every": 0, "keep_last": 1}
    if args.device == "cpu":
        recipe["cluster"] = {"num_gpus_per_engine": 0, "num_gpus_per_trainer": 0}
        recipe["model"]["dtype"] = args.dtype
        recipe["trainer"]["mixed_precision"] = args.dtype == "bfloat16"  # the trainer's bf16 compute copy
    return recipe


def run(args: argparse.Namespace, on: bool, root: Path, index: int) -> dict:
    """Train once; the summary of its metrics.jsonl."""
    from slime_dsa.config import load_recipe  # noqa: PLC0415
    from slime_dsa.orchestrator.train import run_training  # noqa: PLC0415

    name = f"{'on' if on else 'off'}_{index}"
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(args, on, root / name)))
    run_dir = run_training(load_recipe(path, args.set))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "perf/step_time_s" in r]
    times = [r["perf/step_time_s"] for r in steps[1:]] or [r["perf/step_time_s"] for r in steps]
    exact = [r["train/train_rollout_logprob_exact_frac"] for r in steps if "train/train_rollout_logprob_exact_frac" in r]
    gap = [r["train/train_rollout_logprob_abs_diff_max"] for r in steps if "train/train_rollout_logprob_abs_diff_max" in r]
    return {"mode": "on" if on else "off", "steps": len(steps), "step_time_s": statistics.median(times),
            "exact_frac": statistics.mean(exact) if exact else float("nan"),
            "exact_frac_min": min(exact) if exact else float("nan"), "abs_diff_max": max(gap) if gap else float("nan"),
            **{f"{key}_max": largest(steps, f"train/{key}") for key in PER_STEP_ZEROS}}


PER_STEP_ZEROS = ("approx_kl", "icepop_mask_frac")  # PPO-KL and IcePop's masked share: exactly 0 when on-policy


def largest(records: list[dict], key: str) -> float:
    """The largest value of `key` over the steps that log it (nan when none does)."""
    values = [r[key] for r in records if key in r]
    return max(values) if values else float("nan")


def markdown(args: argparse.Namespace, results: list[dict]) -> str:
    by_mode = {m: [r for r in results if r["mode"] == m] for m in ("off", "on")}
    median = {m: statistics.median(r["step_time_s"] for r in rs) for m, rs in by_mode.items()}
    what = args.recipe or f"preset {args.preset} (from scratch, GRPO on arithmetic)"
    lines = [
        f"### True on-policy: step time with model.true_on_policy on vs off ({args.device.upper()})",
        "",
        f"- date: {datetime.date.today().isoformat()}; {platform.processor() or platform.machine()}; recipe: {what}; "
        f"{args.dtype if args.device == 'cpu' else 'recipe dtype'}; {args.steps} steps per run, {args.rounds} round(s) of off then on; `python {' '.join(sys.argv)}`",
        "",
        "| mode | steps | median step time (s) | exact-match fraction (mean, min over steps) | max abs_diff_max | "
        "max PPO-KL (approx_kl) | max IcePop masked fraction |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['mode']} | {r['steps']} | {r['step_time_s']:.3f} | {r['exact_frac']:.4f}, "
                     f"{r['exact_frac_min']:.4f} | {r['abs_diff_max']:.3g} | {r['approx_kl_max']:.3g} | "
                     f"{r['icepop_mask_frac_max']:.3g} |")
    lines += ["", f"Step-time ratio on / off: **{median['on'] / median['off']:.2f}** (medians over rounds)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--recipe", help="a recipe to run (default: a from-scratch GRPO recipe of --preset)")
    parser.add_argument("--preset", default="tiny", choices=["tiny", "quickstart", "small"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="with --device cpu: the engines' dtype (bfloat16: trainer.mixed_precision too)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1, help="off/on pairs, alternated")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override")
    parser.add_argument("--out", help="append the markdown table to this file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    results = []
    with tempfile.TemporaryDirectory(prefix="true_on_policy_") as tmp:
        for i in range(args.rounds):
            for on in (False, True):
                results.append(run(args, on, Path(tmp), i))
                logger.info("%s", results[-1])
    import ray  # noqa: PLC0415

    if ray.is_initialized():
        ray.shutdown()
    report = markdown(args, results)
    print(report)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
