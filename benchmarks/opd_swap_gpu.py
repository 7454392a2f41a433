"""Two teachers swapped from pinned host memory into one engine, on one GPU (issue 16's GPU acceptance point): runs
recipes/gpu_opd_swap.yaml for a few steps and reports each teacher's swap time (the copy of its weights into the
shared engine, timed by the client around /update_weights_from_disk) and its scoring throughput (input tokens per
second of the time it had requests in flight), from the run's teacher/<name>/... metrics.

The student and the two teachers are made here unless given: the small preset (~160M parameters) with the built-in
tokenizer, random weights of different seeds (the swap and scoring costs do not depend on what the weights learnt).
On the device (after benchmarks/gpu_single_device.sh's setup stage; or its `opd` stage, which runs this):
    python3 benchmarks/opd_swap_gpu.py --steps 10 --out $OUT/opd_swap.md
A CPU smoke run of the same path: python benchmarks/opd_swap_gpu.py --cpu --preset tiny --steps 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

logger = logging.getLogger("opd_swap_gpu")
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "gpu_opd_swap.yaml"
TEACHERS = ("countdown_expert", "arithmetic_expert")


def make_model(directory: Path, preset: str, seed: int) -> Path:
    """A random checkpoint of `preset` with the built-in tokenizer (skipped when `directory` holds one)."""
    if (directory / "config.json").exists():
        return directory
    from slime_dsa.checkpoint import build_model, save_pretrained
    from slime_dsa.data.tokenizer import MODEL_VOCAB_SIZE, build_tokenizer, save_tokenizer
    from slime_dsa.models.presets import preset_config

    config = preset_config(preset, vocab_size=MODEL_VOCAB_SIZE, eos_token_id=build_tokenizer().eos_token_id)
    save_pretrained(build_model(config, seed=seed), directory)
    save_tokenizer(directory)
    return directory


def overrides(args: argparse.Namespace) -> list[str]:
    work = args.workdir
    sets = [f"model.path={args.student or make_model(work / 'student', args.preset, 0)}",
            f"teachers.0.path={make_model(work / 'teacher_countdown', args.preset, 1)}",
            f"teachers.1.path={make_model(work / 'teacher_arithmetic', args.preset, 2)}",
            f"trainer.num_steps={args.steps}", f"logging.run_dir={work / 'run'}"]
    if args.cpu:  # the same path on a CPU, small: a smoke test of this script
        sets += ["model.dtype=float32", "model.ops_backend=torch", "trainer.mixed_precision=false",
                 "cluster.num_gpus_per_engine=0", "cluster.num_gpus_per_trainer=0", "cluster.placement=colocated",
                 "rollout.prompts_per_step=8", "rollout.n_samples_per_prompt=4", "rollout.max_response_length=16",
                 "trainer.micro_batch_tokens=8192", "data.tasks.0.train_size=2000", "data.tasks.1.train_size=2000"]
    return sets


def summarise(run_dir: Path) -> dict[str, dict[str, float]]:
    """Per teacher: swaps, mean swap time, scoring tok/s (median over steps after the first), tokens, samples."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    later = records[1:] or records
    out = {}
    for name in TEACHERS:
        key = f"teacher/{name}/"
        swaps = sum(r.get(key + "swaps", 0) for r in records)
        swap_s = sum(r.get(key + "swap_s", 0) for r in records)
        tokens = sum(r.get(key + "tokens", 0) for r in records)
        busy = sum(r.get(key + "busy_s", 0) for r in records)
        out[name] = {"swaps": swaps, "swap_time_mean_s": swap_s / swaps if swaps else float("nan"),
                     "tok_s_overall": tokens / busy if busy else float("nan"),
                     "tok_s_median_step": statistics.median(r.get(key + "tok_s", 0.0) for r in later),
                     "tokens": tokens, "samples": sum(r.get(key + "samples", 0) for r in records)}
    out["step"] = {"step_time_median_s": statistics.median(r["perf/step_time_s"] for r in later),
                   "rollout_time_median_s": statistics.median(r["perf/rollout_time_s"] for r in later)}
    return out


def markdown(args: argparse.Namespace, summary: dict, device: str) -> str:
    import torch

    lines = [
        "### On-policy distillation on one GPU: two teachers swapped from pinned memory into one engine",
        "",
        f"- date: {datetime.date.today().isoformat()}; device: {device}; host: {platform.node()}; "
        f"torch {torch.__version__}",
        f"- command: `python3 benchmarks/opd_swap_gpu.py {shlex.join(sys.argv[1:])}` (recipes/gpu_opd_swap.yaml, "
        f"{args.preset} preset, random weights, {args.steps} steps)",
        f"- step time (median over steps 2..N): {summary['step']['step_time_median_s']:.2f} s, of which rollout "
        f"with teacher scoring {summary['step']['rollout_time_median_s']:.2f} s",
        "",
        "| teacher | swaps | swap time (mean) | scoring tok/s (all steps) | scoring tok/s (median step) | tokens | samples |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in TEACHERS:
        s = summary[name]
        lines.append(f"| {name} | {s['swaps']:.0f} | {1000 * s['swap_time_mean_s']:.1f} ms | {s['tok_s_overall']:.0f} | "
                     f"{s['tok_s_median_step']:.0f} | {s['tokens']:.0f} | {s['samples']:.0f} |")
    lines.append("- scoring tok/s counts the input tokens (prompt + response) a teacher computed per second of the "
                 "time it had requests in flight; a swap is the copy of its weights from pinned host memory into the "
                 "shared engine, timed around the client's /update_weights_from_disk")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("runs/gpu-opd-swap"))
    parser.add_argument("--student", type=Path, help="an HF directory with the built-in tokenizer (default: made)")
    parser.add_argument("--preset", default="small", choices=["tiny", "quickstart", "small"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cpu", action="store_true", help="a smoke run on the CPU")
    parser.add_argument("--out", type=Path, help="write the result section to this markdown file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    import torch

    from slime_dsa.config import load_recipe
    from slime_dsa.orchestrator.train import run_training

    device = "cpu" if args.cpu else torch.cuda.get_device_name()
    run_dir = run_training(load_recipe(RECIPE, overrides(args)))
    summary = summarise(run_dir)
    text = markdown(args, summary, device)
    logger.info("\n%s", text)
    (args.workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
