"""One merge of three experts into a generalist student by on-policy distillation, against multi-task GRPO with
the same budget (issue 16), on CPU, from nothing: every model is made here by the recipes of recipes/opd_merge.yaml.

Stages (each skipped when its output exists, so a run can be resumed; --fresh starts over; --extend continues a
finished merge and its baseline from their last checkpoints to a larger --merge-steps):
  1. student   slime-dsa sft recipes/opd_student.yaml                 the three domains mixed, briefly
  2. experts   per domain: SFT on that domain (recipes/opd_expert_sft.yaml), then GRPO on it
               (recipes/opd_expert_grpo.yaml), exported as the teacher's directory
  3. merge     slime-dsa train recipes/opd_merge.yaml                 OPD, one teacher per domain
  4. baseline  the same recipe with algorithm grpo and no teachers:   the same prompts, samples and steps
Every model is then scored by one evaluator (greedy pass@1 on each domain's 128 held-out prompts). Goal: after the
merge the student is within 5 points of each expert on its domain, and beats the baseline on the average.

    python benchmarks/opd_merge.py --out benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shlex
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

logger = logging.getLogger("opd_merge")
RECIPES = Path(__file__).resolve().parents[1] / "recipes"
DOMAINS = ("arithmetic", "countdown", "sort")


def only(domain: str) -> list[str]:
    """--set overrides that train on `domain` alone (the two other tasks keep their eval prompts)."""
    return [f"data.tasks.{i}.weight=0" for i, d in enumerate(DOMAINS) if d != domain]


def recipe(name: str, sets: list[str]):
    from slime_dsa.config import load_recipe

    return load_recipe(RECIPES / name, sets)


def student(args, root: Path) -> Path:
    from slime_dsa.sft import run_sft

    out = root / "student" / "model"
    if not (out / "config.json").exists():
        run_sft(recipe("opd_student.yaml", [f"trainer.num_steps={args.student_steps}", f"sft.output_dir={out}",
                                            f"logging.run_dir={root / 'student'}"]))
    return out


def expert(args, root: Path, domain: str, student_dir: Path) -> Path:
    from slime_dsa.checkpoint.training import CheckpointManager, export_checkpoint
    from slime_dsa.orchestrator.train import run_training
    from slime_dsa.sft import run_sft

    base, out = root / "experts" / domain, root / "experts" / domain / "model"
    if (out / "config.json").exists():
        return out
    sft = base / "sft"
    if not (sft / "config.json").exists():
        run_sft(recipe("opd_expert_sft.yaml", only(domain) + [
            f"model.path={student_dir}", f"trainer.num_steps={args.expert_sft_steps}", f"sft.output_dir={sft}",
            f"logging.run_dir={base / 'sft_run'}"]))
    if args.expert_rl_steps == 0:
        shutil.copytree(sft, out)
        return out
    run_dir = base / "grpo"
    run_training(recipe("opd_expert_grpo.yaml", only(domain) + [
        f"model.path={sft}", f"trainer.num_steps={args.expert_rl_steps}", f"logging.run_dir={run_dir}",
        f"logging.eval_every={args.expert_rl_steps}"]))
    export_checkpoint(CheckpointManager(run_dir / "checkpoints").latest(), out)
    return out


def merge_sets(args, root: Path, student_dir: Path, experts: dict[str, Path]) -> list[str]:
    sets = [f"model.path={student_dir}", f"trainer.num_steps={args.merge_steps}",
            f"logging.eval_every={args.eval_every}"]
    return sets + [f"teachers.{i}.path={experts[d]}" for i, d in enumerate(DOMAINS)]


def train(args, root: Path, name: str, sets: list[str]) -> tuple[Path, float]:
    """Run recipes/opd_merge.yaml with `sets` into root/name; (exported final model, wall seconds)."""
    from slime_dsa.checkpoint.training import CheckpointManager, export_checkpoint
    from slime_dsa.orchestrator.train import run_training

    run_dir, out = root / name, root / name / "model"
    done = (out / "config.json").exists()
    if done and not args.extend:
        return out, json.loads((run_dir / "wall.json").read_text())["wall_s"]
    earlier = 0.0
    if done:  # the learning rate is constant after warm-up, so resuming equals one longer run
        earlier = json.loads((run_dir / "wall.json").read_text())["wall_s"]
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
    start = time.perf_counter()
    run_training(recipe("opd_merge.yaml", sets + [f"logging.run_dir={run_dir}"]), resume=done)
    wall = earlier + time.perf_counter() - start
    export_checkpoint(CheckpointManager(run_dir / "checkpoints").latest(), out)
    (run_dir / "wall.json").write_text(json.dumps({"wall_s": wall}))
    return out, wall


def evaluate(args, model_dir: Path) -> dict[str, float]:
    """Greedy pass@1 of one model on each domain's held-out prompts."""
    import torch
    from transformers import AutoTokenizer

    from slime_dsa.checkpoint import load_model
    from slime_dsa.data.prompts import build_tasks
    from slime_dsa.sft import greedy_eval

    config = recipe("opd_domains.yaml", [])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_model(model_dir, dtype=torch.float32)
    metrics = greedy_eval(model, tokenizer, build_tasks(config.data, tokenizer), args.eval_prompts,
                          config.rollout.max_response_length)
    return {d: metrics[f"eval/{d}/pass@1"] for d in DOMAINS}


def curves(run_dir: Path, pattern: str) -> dict[str, list[tuple[int, float]]]:
    """{domain: [(step, value)]} of metrics.jsonl keys pattern.format(domain)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {d: [(r["step"], r[pattern.format(d)]) for r in records if pattern.format(d) in r] for d in DOMAINS}


def plot(merge_dir: Path, baseline_dir: Path, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for d, points in curves(merge_dir, "opd/{}/reverse_kl").items():
        if points:
            left.plot(*zip(*points), label=d)
    left.set(title="Reverse KL to each domain's teacher (merge)", xlabel="step",
             ylabel="log π_student − log π_teacher per token")
    for name, run_dir, style in (("merge", merge_dir, "-"), ("GRPO", baseline_dir, "--")):
        for d, points in curves(run_dir, "eval/{}/pass@1").items():
            if points:
                right.plot(*zip(*points), style, label=f"{name}: {d}")
    right.set(title="Greedy eval pass@1 per domain", xlabel="step", ylabel="pass@1")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(args, scores: dict[str, dict[str, float]], walls: dict[str, float], merge_dir: Path,
             figure: Path | None) -> str:
    cmd = "python benchmarks/opd_merge.py " + shlex.join(sys.argv[1:])
    import torch

    merge = recipe("opd_merge.yaml", [])

    lines = [
        "### On-policy distillation: three experts merged into one student vs multi-task GRPO (CPU)",
        "",
        f"- date: {datetime.date.today().isoformat()}; hardware: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores (shared with other jobs), load average {os.getloadavg()[0]:.1f} at the end; "
        f"torch {torch.__version__}",
        f"- command: `{cmd}`",
        f"- models: the quickstart preset (~1.4M parameters), built-in tokenizer; student = SFT from scratch on the "
        f"three domains mixed ({args.student_steps} steps of 64); expert = student + SFT on its domain "
        f"({args.expert_sft_steps} steps) + GRPO on it ({args.expert_rl_steps} steps, recipes/opd_expert_grpo.yaml)",
        f"- merge: recipes/opd_merge.yaml, {args.merge_steps} steps x 24 prompts x 4 samples, opd_coef "
        f"{merge.algorithm.opd_coef:g}, opd_topk {merge.algorithm.opd_topk}, lr {merge.trainer.learning_rate:g}, "
        f"{merge.trainer.num_steps_per_rollout} optimizer step(s) a step, "
        f"2 engines + 2 trainer ranks + one engine per teacher; baseline: the same recipe with algorithm grpo and no "
        f"teachers (same prompts, samples, steps, learning rate). Wall time: merge {walls['merge']:.0f} s, GRPO "
        f"{walls['grpo']:.0f} s",
        f"- eval: greedy pass@1 on {args.eval_prompts} held-out prompts per domain, one evaluator for every model",
        "",
        "| domain | student before | expert | student after (OPD) | multi-task GRPO | OPD − expert |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for d in DOMAINS:
        gap = scores["merge"][d] - scores["expert"][d]
        lines.append(f"| {d} | {scores['student'][d]:.3f} | {scores['expert'][d]:.3f} | {scores['merge'][d]:.3f} | "
                     f"{scores['grpo'][d]:.3f} | {100 * gap:+.1f} pts |")
    avg = {k: sum(v.values()) / len(v) for k, v in scores.items()}
    lines.append(f"| average | {avg['student']:.3f} | {avg['expert']:.3f} | {avg['merge']:.3f} | {avg['grpo']:.3f} | |")
    lines.append("")
    within = {d: scores["merge"][d] >= scores["expert"][d] - 0.05 for d in DOMAINS}
    lines.append("- goal, within 5 points of each expert on its domain: "
                 + ", ".join(f"{d} {'met' if ok else 'MISSED'}" for d, ok in within.items()))
    beats = avg["merge"] > avg["grpo"]
    lines.append(f"- goal, beat multi-task GRPO on the average: {'met' if beats else 'MISSED'} "
                 f"({avg['merge']:.3f} vs {avg['grpo']:.3f})")
    for d, points in curves(merge_dir, "opd/{}/reverse_kl").items():
        step = max(1, len(points) // 10)
        lines.append(f"- reverse KL per token, {d} (step:value): "
                     + " ".join(f"{s}:{v:.3f}" for s, v in points[::step] + points[-1:]))
    if figure is not None:
        lines.append(f"- curves: `{figure}` (reverse KL per domain; eval pass@1 per domain, merge and GRPO)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path("runs/opd_merge"))
    parser.add_argument("--student-steps", type=int, default=400)
    parser.add_argument("--expert-sft-steps", type=int, default=600)
    parser.add_argument("--expert-rl-steps", type=int, default=60)
    parser.add_argument("--merge-steps", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-prompts", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of this process (SFT, eval)")
    parser.add_argument("--fresh", action="store_true", help="remove --root first")
    parser.add_argument("--extend", action="store_true",
                        help="continue a finished merge and baseline from their last checkpoints to --merge-steps")
    parser.add_argument("--figure", type=Path, default=Path("docs/opd_merge.png"))
    parser.add_argument("--out", type=Path, help="append the result section to this markdown file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    import ray
    import torch

    torch.set_num_threads(args.threads)  # on a shared machine one thread per process keeps step times steady

    if args.fresh:
        shutil.rmtree(args.root, ignore_errors=True)
    # One local cluster for every stage, with room for the merge's actors (2 engines, 2 ranks, 3 teachers).
    ray.init(num_cpus=16, include_dashboard=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}})
    student_dir = student(args, args.root)
    experts = {d: expert(args, args.root, d, student_dir) for d in DOMAINS}
    sets = merge_sets(args, args.root, student_dir, experts)
    merged, merge_wall = train(args, args.root, "merge", sets)
    # The merge's OPD-only options back to their defaults: GRPO reads none of them (recipe check refuses them)
    baseline, grpo_wall = train(args, args.root, "grpo",
                                sets + ["algorithm.name=grpo", "algorithm.opd_topk=0", "teachers=[]"])
    scores = {"student": evaluate(args, student_dir), "merge": evaluate(args, merged),
              "grpo": evaluate(args, baseline)}
    scores["expert"] = {d: evaluate(args, experts[d])[d] for d in DOMAINS}
    (args.root / "scores.json").write_text(json.dumps(scores, indent=2))
    args.figure.parent.mkdir(parents=True, exist_ok=True)
    plot(args.root / "merge", args.root / "grpo", args.figure)
    text = markdown(args, scores, {"merge": merge_wall, "grpo": grpo_wall}, args.root / "merge", args.figure)
    logger.info("\n%s", text)
    if args.out:
        with args.out.open("a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
