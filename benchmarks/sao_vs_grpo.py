"""SAO against GRPO+DIS at the same number of generated tokens, from the same SFT policy (issue 15).

Both run the asynchronous loop with the DIS actor loss (r = π_θ / π_roll, window --dis-eps-low/--dis-eps-high) and
the same staleness bound, learning rate, task and seed; they differ in where advantages come from:
- grpo: `async_reinforce`, group-centred rewards over --group-size samples per prompt (GLM-5's async stage);
- sao: one rollout per prompt, per-token GAE from a value model initialised from the policy (critic warm-up,
  --critic-updates passes per actor update).
Each step generates --samples-per-step responses in both (grpo: samples/group prompts, sao: that many prompts), and
both count every model-generated token (rollout/generated_tokens, warm-up included for sao). Greedy eval on the
task's held-out prompts every --eval-every steps gives the curves (eval reward and pass@1 against tokens).

The goal the issue sets (on the agentic task): SAO reaches GRPO's final eval reward with <= 0.7x the tokens, or ends
higher. Any task runs (--task, a data.tasks kind, with --task-args as JSON):

    python benchmarks/sao_vs_grpo.py --task arithmetic --model recipes/assets/quickstart-sft --out benchmarks/RESULTS.md

The agentic task (multi-turn, the real calculator) from the tool-using SFT policy of recipes/agentic_sft.yaml:

    python benchmarks/sao_vs_grpo.py --task calc_chain --model recipes/assets/agentic-sft --lr 1e-4 \
        --task-args '{"min_steps": 1, "max_steps": 1, "start_digits": 2, "operand_digits": 1}' \
        --max-prompt-length 64 --max-response-length 96 --samples-per-step 64 --eval-every 5 --eval-size 128

Each invocation trains one seed and keeps its runs and result.json under --work-dir. Seeds and algorithms may run
as separate invocations (in parallel on a loaded machine); --combine DIR... then writes one section for all of
them: a table per seed, the verdict per seed, and every curve in one plot.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

logger = logging.getLogger("sao_vs_grpo")


def recipe_dict(args: argparse.Namespace, algorithm: str, run_dir: Path) -> dict:
    """The shared recipe; only the algorithm section and the prompts per step differ."""
    task = {"kind": args.task, "eval_size": args.eval_size, "train_size": args.train_size,
            "task_args": json.loads(args.task_args)}
    common_alg = {"dis_eps_low": args.dis_eps_low, "dis_eps_high": args.dis_eps_high,
                  "max_staleness": args.max_staleness}
    recipe = {
        "model": {"path": str(args.model)},
        "data": {"tasks": [task], "apply_chat_template": True, "max_prompt_length": args.max_prompt_length,
                 "seed": args.seed},
        "rollout": {"num_engines": args.num_engines, "max_response_length": args.max_response_length,
                    "temperature": 1.0},
        "trainer": {"num_workers": 1, "learning_rate": actor_lr(args, algorithm), "warmup_steps": args.lr_warmup,
                    "num_steps": args.steps,
                    "micro_batch_tokens": 4096, "seed": args.seed},
        "logging": {"wandb_mode": "disabled", "run_dir": str(run_dir), "eval_every": args.eval_every},
        "checkpoint": {"save_every": 0, "keep_last": 1},
    }
    if algorithm == "sao":
        recipe["algorithm"] = {"name": "sao", **common_alg, "critic_warmup_steps": args.critic_warmup,
                               "critic_updates_per_step": args.critic_updates}
        recipe["rollout"].update(n_samples_per_prompt=1, prompts_per_step=args.samples_per_step)
        recipe["critic"] = {"learning_rate": args.critic_lr}
    else:
        recipe["algorithm"] = {"name": "async_reinforce", **common_alg}
        recipe["rollout"].update(n_samples_per_prompt=args.group_size,
                                 prompts_per_step=args.samples_per_step // args.group_size)
    return recipe


def actor_lr(args: argparse.Namespace, algorithm: str) -> float:
    """The policy's learning rate: --lr, or --grpo-lr for grpo when given."""
    return args.grpo_lr if algorithm == "grpo" and args.grpo_lr is not None else args.lr


def run(args: argparse.Namespace, algorithm: str, root: Path) -> tuple[Path, float]:
    """Train one algorithm; (run dir, seconds)."""
    from slime_dsa.config import load_recipe
    from slime_dsa.orchestrator.train import run_training

    path = root / f"{algorithm}.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(args, algorithm, root / algorithm)))
    start = time.perf_counter()
    run_dir = run_training(load_recipe(path))
    return run_dir, time.perf_counter() - start


def curve(run_dir: Path) -> list[dict]:
    """[{step, tokens, reward, pass1}] at every eval (step 0 = the SFT policy), tokens = model tokens generated so far."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tokens, points = 0, []
    for r in records:
        tokens += r.get("rollout/generated_tokens", 0)
        if "eval/reward_mean" in r:
            points.append({"step": r["step"], "tokens": tokens, "reward": r["eval/reward_mean"],
                           "pass1": r["eval/pass@1"]})
    return points


def tokens_to_reach(points: list[dict], target: float) -> int | None:
    """Generated tokens at the first eval after training began at or above `target`; None if none is."""
    return next((p["tokens"] for p in points if p["tokens"] > 0 and p["reward"] >= target), None)


def verdict(grpo: list[dict], sao: list[dict]) -> str:
    """The issue's goal on these curves: SAO reaches GRPO's final eval reward with <= 0.7x the tokens, or ends
    higher. When GRPO ends at or below the starting policy the goal has no target worth the name: said so."""
    target, grpo_tokens, start = grpo[-1]["reward"], grpo[-1]["tokens"], grpo[0]["reward"]
    reach = tokens_to_reach(sao, target)
    ratio = None if reach is None else reach / grpo_tokens
    ends_higher = sao[-1]["reward"] > target
    met = (ratio is not None and ratio <= 0.7) or ends_higher
    text = (f"SAO tokens to GRPO's final eval reward ({target:.3f}): "
            + ("not reached" if reach is None else f"{reach} = {ratio:.2f}x GRPO's {grpo_tokens}")
            + f"; SAO ends {'higher' if ends_higher else 'not higher'} ({sao[-1]['reward']:.3f}). "
            f"Goal (<= 0.7x the tokens, or ends higher): {'met' if met else 'NOT met'}")
    if target <= start:
        text += (f" (GRPO ended at or below the starting policy's {start:.3f}: the target is the start, so this "
                 "says little)")
    return text


def plot(results: list[dict], path: Path) -> None:
    """Eval reward against generated tokens: one colour per algorithm, one line style per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours, styles = {"grpo": "tab:blue", "sao": "tab:orange"}, ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, result in enumerate(sorted(results, key=lambda r: r["seed"])):
        for name, points in sorted(result["curves"].items()):
            ax.plot([p["tokens"] / 1e3 for p in points], [p["reward"] for p in points], marker="o", markersize=3,
                    color=colours.get(name), linestyle=styles[i % len(styles)], label=f"{name} seed {result['seed']}")
    ax.set_xlabel("model tokens generated (thousands)")
    ax.set_ylabel("greedy eval reward (mean)")
    ax.set_title(f"SAO vs GRPO+DIS at equal generated tokens: {results[0]['args']['task']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge_results(results: list[dict]) -> list[dict]:
    """One result per seed: the curves and wall times of its algorithms (run apart or together) side by side."""
    by_seed: dict[int, dict] = {}
    for r in results:
        seed = by_seed.setdefault(r["seed"], {"seed": r["seed"], "args": r["args"], "commands": [], "curves": {},
                                              "seconds": {}, "load": []})
        seed["commands"].append(r["command"])
        seed["curves"].update(r["curves"])
        seed["seconds"].update(r["seconds"])
        seed["load"].append(r["load"])
    return [by_seed[k] for k in sorted(by_seed)]


def _tail_mean(points: list[dict], n: int = 3) -> float:
    return sum(p["reward"] for p in points[-n:]) / len(points[-n:])


def markdown(results: list[dict]) -> str:
    """The RESULTS.md section: setup, a row per seed and algorithm, each seed's verdict and curves."""
    import torch

    a = results[0]["args"]
    group = a["group_size"]
    grpo_lr = a["grpo_lr"] if a.get("grpo_lr") is not None else a["lr"]
    loads = [x for r in results for x in r["load"]]
    lines = [
        f"### SAO vs GRPO+DIS (group {group}) at equal generated tokens: {a['task']}, CPU",
        "",
        f"- date: {datetime.date.today().isoformat()}; hardware: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores (shared with other jobs), 1-min load average {min(loads):.1f}-{max(loads):.1f} at the "
        f"ends of the runs; torch {torch.__version__}",
        *[f"- command: `{c}`" for r in results for c in r["commands"]],
        f"- both: policy `{a['model']}`, task `{a['task']}` {a['task_args']}, {a['samples_per_step']} trajectories/step "
        f"of at most {a['max_response_length']} tokens, {a['steps']} steps, asynchronous loop (max_staleness "
        f"{a['max_staleness']}), DIS window ({1 - a['dis_eps_low']:g}, {1 + a['dis_eps_high']:g}), lr warm-up "
        f"{a['lr_warmup']}, 1 engine + 1 trainer rank; greedy eval on {a['eval_size']} held-out prompts every "
        f"{a['eval_every']} steps",
        f"- grpo: async_reinforce, {a['samples_per_step'] // group} prompts x {group} samples, group-centred "
        f"advantages, actor lr {grpo_lr:g}",
        f"- sao: {a['samples_per_step']} prompts x 1 sample, actor lr {a['lr']:g}, critic from the policy (lr "
        f"{a['critic_lr']:g}, {a['critic_updates']} passes per actor update, {a['critic_warmup']} warm-up steps that "
        "train the critic only)",
        "",
        "| seed | algorithm | wall (s) | tokens generated | eval reward: start → final (best) | mean of last 3 evals |",
        "|---|---|---:|---:|---|---:|",
    ]
    for r in results:
        for name, points in sorted(r["curves"].items()):
            best = max(points, key=lambda p: p["reward"])
            lines.append(f"| {r['seed']} | {name} | {r['seconds'][name]:.0f} | {points[-1]['tokens']} | "
                         f"{points[0]['reward']:.3f} → {points[-1]['reward']:.3f} ({best['reward']:.3f} at "
                         f"{best['tokens'] / 1e3:.0f}k) | {_tail_mean(points):.3f} |")
    lines.append("")
    for r in results:
        grpo, sao = r["curves"].get("grpo"), r["curves"].get("sao")
        if grpo and sao:
            lines.append(f"- seed {r['seed']}: {verdict(grpo, sao)}")
    for r in results:
        for name, points in sorted(r["curves"].items()):
            lines.append(f"- seed {r['seed']} {name} curve (k tokens: eval reward): "
                         + " ".join(f"{p['tokens'] / 1e3:.0f}k:{p['reward']:.3f}" for p in points))
    return "\n".join(lines) + "\n"


def train_seed(args: argparse.Namespace, work_dir: Path) -> dict:
    """Train --algorithms for --seed under work_dir; the result (also written to work_dir/result.json)."""
    import ray

    curves, seconds = {}, {}
    try:
        for name in args.algorithms.split(","):
            run_dir, seconds[name] = run(args, name, work_dir)
            curves[name] = curve(run_dir)
            logger.info("%s: %s", name, curves[name])
    finally:
        if ray.is_initialized():
            ray.shutdown()
    saved_args = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result = {"seed": args.seed, "args": saved_args, "command": "python benchmarks/sao_vs_grpo.py "
              + shlex.join(sys.argv[1:]), "curves": curves, "seconds": seconds, "load": os.getloadavg()[0]}
    (work_dir / "result.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="arithmetic", help="a data.tasks kind (arithmetic, countdown, ...)")
    parser.add_argument("--task-args", default='{"max_digits": 2}', help="its task_args, as JSON")
    parser.add_argument("--model", type=Path, default=Path("recipes/assets/quickstart-sft"), help="the SFT policy")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--samples-per-step", type=int, default=128)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-prompt-length", type=int, default=64)
    parser.add_argument("--max-response-length", type=int, default=12)
    parser.add_argument("--train-size", type=int, default=15000)
    parser.add_argument("--eval-size", type=int, default=256)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--lr", type=float, default=5e-4, help="the actor's learning rate (both algorithms)")
    parser.add_argument("--grpo-lr", type=float, help="grpo's actor learning rate when it differs from --lr")
    parser.add_argument("--lr-warmup", type=int, default=5)
    parser.add_argument("--critic-lr", type=float, default=2.5e-3)
    parser.add_argument("--critic-updates", type=int, default=2)
    parser.add_argument("--critic-warmup", type=int, default=5)
    parser.add_argument("--dis-eps-low", type=float, default=0.3)
    parser.add_argument("--dis-eps-high", type=float, default=5.0)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--num-engines", type=int, default=1)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--algorithms", default="grpo,sao")
    parser.add_argument("--work-dir", type=Path, help="where the runs and result.json go (default: a new temp dir)")
    parser.add_argument("--combine", type=Path, nargs="+", metavar="WORK_DIR",
                        help="train nothing: report the result.json of these work dirs (seeds, algorithms) together")
    parser.add_argument("--plot", type=Path, help="write the eval-reward curves against tokens to this PNG")
    parser.add_argument("--out", type=Path, help="append the result section to this markdown file")
    args = parser.parse_args(argv)
    if args.samples_per_step % args.group_size:
        parser.error(f"--samples-per-step ({args.samples_per_step}) must be a multiple of --group-size")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    if args.combine:
        missing = [str(d) for d in args.combine if not (d / "result.json").is_file()]
        if missing:
            parser.error(f"no result.json in {', '.join(missing)}")
        results = [json.loads((d / "result.json").read_text()) for d in args.combine]
    else:
        work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="sao_vs_grpo-"))
        work_dir.mkdir(parents=True, exist_ok=True)
        results = [train_seed(args, work_dir)]
    merged = merge_results(results)
    report = markdown(merged)
    logger.info("\n%s", report)
    if args.plot:
        plot(merged, args.plot)
    if args.out:
        with args.out.open("a") as f:
            f.write("\n" + report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
