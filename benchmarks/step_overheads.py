"""Where the synchronous RL step's fixed costs go: the real loop (`run_training`, Ray, embedded engines), with every
engine HTTP request and trainer-group Ray call counted and timed by the phase of the step it is made in.

Phases of `_one_step`: rollout (collect_step: generation), train (train_on_samples: batch, memory hand-over,
training), sync (sync_weights: the weight push), tail (after_step: engine stats, log). What runs between the end of
one rollout and the start of the next is train + sync + tail; this script prints its requests and round trips per
step, the engine's own command time (perf/engine_command_s, of it perf/engine_weights_update_s) and the phases'
medians over steps 2..N.

  python benchmarks/step_overheads.py                    # CPU, tiny preset, shm (or http) weight sync
  python benchmarks/step_overheads.py --baseline REF     # also the code of git REF (or a directory), alternated
  python benchmarks/step_overheads.py --device cuda      # one GPU: colocated, bf16, cuda_ipc (recipes/gpu_single.yaml)

--baseline runs this same script against the baseline's code (PYTHONPATH; a git REF is exported with `git archive`),
alternating with the working tree --rounds times, so both sides see the same machine load.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

logger = logging.getLogger("step_overheads")
PHASES = ("rollout", "train", "sync", "tail")
BETWEEN = ("train", "sync", "tail")  # from the end of one rollout to the start of the next
ENGINE_KEYS = ("engine_command_s", "engine_commands", "engine_weights_update_s", "sync_time_s", "train_time_s",
               "rollout_time_s", "step_time_s", "rollout_sleep_s", "rollout_wake_s")
TRAINER_CALLS = ("train", "full_state_dict", "save_weights", "share_weights", "release_memory", "resume_memory",
                 "release_memory_and_share_weights",
                 "compute_logprobs", "broadcast_weights", "save_checkpoint")


class Recorder:
    """Counts and times calls by (step, phase, kind, name); kind is http (one entry per request) or ray (one per
    fan-out over the trainer ranks)."""

    def __init__(self) -> None:
        self.step = 0
        self.phase = "setup"
        self.calls: dict[tuple[int, str, str, str], list[float]] = defaultdict(lambda: [0, 0.0])
        self.phase_s: dict[tuple[int, str], float] = defaultdict(float)

    def add(self, kind: str, name: str, seconds: float, count: int = 1) -> None:
        entry = self.calls[(self.step, self.phase, kind, name)]
        entry[0] += count
        entry[1] += seconds


REC = Recorder()


def _timed_async(fn: Any, kind: str, name_of: Any) -> Any:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            name, count = name_of(*args, **kwargs)
            REC.add(kind, name, time.perf_counter() - start, count)
    return wrapper


def _timed_sync(fn: Any, name: str) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            REC.add("ray", name, time.perf_counter() - start)
    return wrapper


def _phase(fn: Any, phase: str) -> Any:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        before, REC.phase = REC.phase, phase
        start = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            REC.phase_s[(REC.step, phase)] += time.perf_counter() - start
            REC.phase = before
    return wrapper


def instrument() -> None:
    """Wrap the engine client's requests, the trainer group's calls and the sync loop's phases (this process)."""
    from rollout.client import EngineClient
    from slime_dsa.orchestrator import train
    from slime_dsa.orchestrator.rollout_manager import RolloutManager
    from trainers.group import RayTrainerGroup

    EngineClient.broadcast = _timed_async(
        EngineClient.broadcast, "http",
        lambda self, path, *a, **k: (f"{k.get('method', 'POST')} {path}", max(1, len(self.engines) + len(self.staged))))
    EngineClient.post_to = _timed_async(EngineClient.post_to, "http", lambda self, url, path, *a, **k: (f"POST {path}", 1))
    EngineClient.get = _timed_async(EngineClient.get, "http", lambda self, url, path, *a, **k: (f"GET {path}", 1))
    EngineClient.request = _timed_async(EngineClient.request, "http", lambda self, path, *a, **k: (f"POST {path}", 1))
    for name in TRAINER_CALLS:
        if hasattr(RayTrainerGroup, name):
            setattr(RayTrainerGroup, name, _timed_sync(getattr(RayTrainerGroup, name), name))
    RolloutManager.collect_step = _phase(RolloutManager.collect_step, "rollout")
    for attr, phase in (("train_on_samples", "train"), ("sync_weights", "sync"), ("after_step", "tail")):
        setattr(train, attr, _phase(getattr(train, attr), phase))
    one_step = train._one_step

    async def counted_step(run: Any, step: int, *args: Any, **kwargs: Any) -> Any:
        REC.step = step + 1
        return await one_step(run, step, *args, **kwargs)
    train._one_step = counted_step


def recipe_dict(args: argparse.Namespace, model_dir: Path, run_dir: Path) -> dict[str, Any]:
    """GRPO on arithmetic with the benchmark's sizes; --device cuda takes recipes/gpu_single.yaml's placement."""
    cuda = args.device == "cuda"
    recipe: dict[str, Any] = {
        "model": {"path": str(model_dir), "dtype": "bfloat16" if cuda else "float32"},
        "data": {"tasks": [{"kind": "arithmetic", "eval_size": 16, "train_size": 2000, "task_args": {"max_digits": 2}}],
                 "apply_chat_template": True, "max_prompt_length": 64, "seed": 0},
        "rollout": {"num_engines": args.engines, "n_samples_per_prompt": args.group_size,
                    "prompts_per_step": args.prompts_per_step, "max_response_length": args.max_new_tokens,
                    "temperature": 1.0, "weight_sync": args.weight_sync},
        "algorithm": {"name": "grpo", "use_rollout_logprobs": True},
        "trainer": {"num_workers": args.workers, "data_parallel": "replicate", "learning_rate": 1e-4,
                    "num_steps": args.steps, "warmup_steps": 0, "num_steps_per_rollout": 1, "seed": 0},
        "logging": {"wandb_mode": "disabled", "run_dir": str(run_dir), "eval_every": 0},
        "checkpoint": {"save_every": 0, "keep_last": 1},
    }
    if cuda:
        recipe["model"]["ops_backend"] = "auto"
        recipe["trainer"]["mixed_precision"] = True
        del recipe["trainer"]["data_parallel"]
        recipe["cluster"] = {"placement": "colocated", "num_gpus_per_engine": 0.5, "num_gpus_per_trainer": 0.5}
    return recipe


def build_model(preset: str, workdir: Path) -> Path:
    from slime_dsa.checkpoint import build_model as build, save_pretrained
    from slime_dsa.data.tokenizer import build_tokenizer
    from slime_dsa.models.presets import preset_config

    tokenizer = build_tokenizer()
    target = workdir / f"random_{preset}"
    model = build(preset_config(preset, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id), seed=0)
    save_pretrained(model, target)
    tokenizer.save_pretrained(target)
    return target


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One run of the loop in this process; the per-step breakdown (steps 2..N)."""
    import ray
    import yaml

    from slime_dsa.config import load_recipe
    from slime_dsa.logging.metrics import read_metrics
    from slime_dsa.orchestrator.train import run_training

    instrument()
    with tempfile.TemporaryDirectory(prefix="step_overheads-") as tmp:
        workdir = Path(tmp)
        model_dir = args.model or build_model(args.preset, workdir)
        path = workdir / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe_dict(args, model_dir, workdir / "run")))
        try:
            run_dir = run_training(load_recipe(path), loop="sync")
        finally:
            if ray.is_initialized():
                ray.shutdown()
        records = [r for r in read_metrics(run_dir) if "perf/step_time_s" in r]
    return summarise(args, records)


def summarise(args: argparse.Namespace, records: list[dict]) -> dict[str, Any]:
    steps = list(range(2, args.steps + 1))  # step 1 compiles, warms up and allocates
    per_step: dict[tuple[str, str, str], list[list[float]]] = defaultdict(lambda: [[0.0] * len(steps), [0.0] * len(steps)])
    for (step, phase, kind, name), (count, seconds) in REC.calls.items():
        if step in steps:
            entry = per_step[(phase, kind, name)]
            entry[0][steps.index(step)] += count
            entry[1][steps.index(step)] += seconds
    calls = [{"phase": p, "kind": k, "name": n, "per_step": statistics.median(c), "s_per_step": statistics.median(s)}
             for (p, k, n), (c, s) in sorted(per_step.items())]
    phases = {p: statistics.median(REC.phase_s.get((s, p), 0.0) for s in steps) for p in PHASES}
    later = [r for r in records if r.get("step", 0) >= 2] or records
    engine = {k: statistics.median(r.get(f"perf/{k}", 0.0) for r in later) for k in ENGINE_KEYS}
    between = [c for c in calls if c["phase"] in BETWEEN]
    return {"phases": phases, "engine": engine, "calls": calls,
            "between_http": sum(c["per_step"] for c in between if c["kind"] == "http"),
            "between_ray": sum(c["per_step"] for c in between if c["kind"] == "ray"),
            "between_s": sum(phases[p] for p in BETWEEN)}


def table(result: dict[str, Any]) -> str:
    lines = ["| phase | s/step (median) |", "|---|---:|"]
    lines += [f"| {p} | {result['phases'][p]:.4f} |" for p in PHASES]
    lines += ["", "| phase | kind | call | per step | s/step |", "|---|---|---|---:|---:|"]
    lines += [f"| {c['phase']} | {c['kind']} | {c['name']} | {c['per_step']:g} | {c['s_per_step']:.4f} |"
              for c in result["calls"] if c["phase"] != "rollout" or not c["name"].endswith("/generate")]
    lines += ["", f"between rollouts: {result['between_s']:.4f} s, {result['between_http']:g} HTTP requests, "
              f"{result['between_ray']:g} trainer-group Ray calls per step",
              "engine (perf/, medians): " + ", ".join(f"{k} {v:.4f}" for k, v in result["engine"].items())]
    return "\n".join(lines)


def compare(args: argparse.Namespace, argv: list[str]) -> None:
    """This script over the baseline's code and over the working tree, alternated; medians and after/before ratios.
    The baseline is a source directory, or a git ref exported with `git archive`."""
    root = Path(__file__).resolve().parents[1]
    forwarded = [a for i, a in enumerate(argv) if not _is_compare_arg(argv, i)]
    sides: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="step_overheads-base-") as tmp:
        base = Path(args.baseline).resolve() if Path(args.baseline).is_dir() else _export(root, args.baseline, Path(tmp))
        for i in range(args.rounds):
            for side, tree in (("before", base), ("after", root)):
                out, log = Path(tmp) / f"{side}.json", Path(tmp) / f"{side}.log"
                env = {**os.environ, "PYTHONPATH": _python_path(tree, root)}
                with log.open("w") as f:
                    done = subprocess.run([sys.executable, __file__, *forwarded, "--json", str(out)], env=env,
                                          cwd=tree, stdout=f, stderr=subprocess.STDOUT)
                if done.returncode:
                    raise SystemExit(f"{side} run {i + 1} failed ({done.returncode}); its log's tail:\n"
                                     + "\n".join(log.read_text().splitlines()[-30:]))
                sides[side].append(json.loads(out.read_text()))
                logger.warning("round %d %s: between rollouts %.4f s, step %.4f s", i + 1, side,
                               sides[side][-1]["between_s"], sides[side][-1]["engine"]["step_time_s"])
    print(f"before: {args.baseline}; after: the working tree; {args.rounds} run(s) each, alternated; medians of the "
          f"runs' medians over steps 2..{args.steps}")
    rows = [("between rollouts, s", lambda r: r["between_s"]),
            ("HTTP requests between rollouts", lambda r: r["between_http"]),
            ("Ray calls between rollouts", lambda r: r["between_ray"])]
    rows += [(f"phase {p}, s", functools.partial(lambda r, p: r["phases"][p], p=p)) for p in PHASES]
    rows += [(f"perf/{k}", functools.partial(lambda r, k: r["engine"][k], k=k)) for k in ENGINE_KEYS]
    print("| quantity | before | after | after/before | before, each run | after, each run |")
    print("|---|---:|---:|---:|---|---|")
    for label, get in rows:
        runs = {s: [get(r) for r in sides[s]] for s in sides}
        b, a = (statistics.median(runs[s]) for s in ("before", "after"))
        each = {s: " ".join(f"{v:.4g}" for v in runs[s]) for s in sides}
        print(f"| {label} | {b:.4g} | {a:.4g} | {a / b if b else float('nan'):.2f} | {each['before']} | "
              f"{each['after']} |")
    for side in ("before", "after"):
        print(f"\n{side} (its last run):\n{table(sides[side][-1])}")


def _python_path(tree: Path, root: Path) -> str:
    """PYTHONPATH with `tree` first and the working tree's own entries left out (installed packages stay)."""
    own = {str(root), ".", ""}
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p not in own and Path(p or ".").resolve() != root]
    return os.pathsep.join([str(tree), *rest])


def _export(root: Path, ref: str, into: Path) -> Path:
    """The tree of git `ref` under `into`/base."""
    base = into / "base"
    base.mkdir()
    archive = subprocess.run(["git", "-C", str(root), "archive", ref], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(base)], input=archive.stdout, check=True)
    return base


def _is_compare_arg(argv: list[str], i: int) -> bool:
    if argv[i].startswith(("--baseline", "--rounds")):
        return True
    return i > 0 and argv[i - 1] in ("--baseline", "--rounds")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", type=Path, default=None, help="HF model directory (default: a random --preset model)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--weight-sync", default="auto", help="rollout.weight_sync (auto: cuda_ipc on one GPU, shm on CPU)")
    p.add_argument("--baseline", default=None,
                   help="a source directory or a git ref: also run its code, alternated, and print ratios")
    p.add_argument("--rounds", type=int, default=2, help="runs per side with --baseline")
    p.add_argument("--json", type=Path, default=None, help="write the breakdown here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    if args.baseline:
        compare(args, argv)
        return 0
    result = measure(args)
    if args.json:
        args.json.write_text(json.dumps(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
