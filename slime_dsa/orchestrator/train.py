"""`slime-dsa train`: the RL loops, with eval, logging and checkpoints. The synchronous loop (rollout → train →
weight sync) lives here; the asynchronous one (algorithm async_reinforce) in async_loop.py shares its setup,
training step, per-step tail and teardown.

Built in the order a reader follows: run directory → model → Ray → engines → client → trainers → data → loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from slime_dsa.config import RecipeConfig

logger = logging.getLogger(__name__)

# Called with (weight version, full state dict) each time the engines get new weights, and once with the
# starting weights; benchmarks use it to evaluate every version after the run, off the clock. With
# hook_state "last" the state dict comes with the last version only (None before it): reading the weights back
# cost the push ~0.5 s a step for a 160M-parameter model on an H200, which a benchmark timing steps must not add.
WeightsHook = Callable[[int, dict | None], None]
HookState = Literal["every", "last"]


@dataclass
class Run:
    """Everything a loop needs, built once by `_run`."""

    recipe: RecipeConfig
    run_dir: Path
    model_dir: Path
    client: Any  # rollout.client.EngineClient
    trainers: Any  # trainers.fsdp.group.TrainerGroup
    manager: Any  # slime_dsa.orchestrator.rollout_manager.RolloutManager
    ckpts: Any  # slime_dsa.checkpoint.training.CheckpointManager
    metrics_log: Any  # slime_dsa.logging.MetricsLogger
    weights: Any  # slime_dsa.orchestrator.weight_sync.WeightSync
    start_step: int = 0
    on_weights: WeightsHook | None = None
    hook_state: HookState = "every"

    def hook_wants_state(self, version: int) -> bool:
        """Whether on_weights gets the full state dict with weight `version`."""
        return self.on_weights is not None and (self.hook_state == "every" or version == self.recipe.trainer.num_steps)


def run_training(recipe: RecipeConfig, resume: bool = False, loop: Literal["auto", "sync", "async"] = "auto",
                 on_weights: WeightsHook | None = None, hook_state: HookState = "every") -> Path:
    """Run the recipe to trainer.num_steps; returns the run directory.

    loop: auto = the asynchronous loop for algorithm async_reinforce, else the synchronous one; sync/async force
    one (comparisons of the two on one recipe). on_weights, hook_state: see WeightsHook.
    """
    if hook_state not in ("every", "last"):
        raise ValueError(f"hook_state must be every or last, got {hook_state!r}")
    return asyncio.run(_run(recipe, resume or recipe.checkpoint.resume, loop, on_weights, hook_state))


async def _run(recipe: RecipeConfig, resume: bool, loop: str = "auto", on_weights: WeightsHook | None = None,
               hook_state: HookState = "every") -> Path:
    from rollout.client import EngineClient  # noqa: PLC0415
    from slime_dsa.checkpoint.training import CheckpointManager, read_orchestrator_state  # noqa: PLC0415
    from slime_dsa.data.prompts import TaskMixture, build_tasks  # noqa: PLC0415
    from slime_dsa.logging import MetricsLogger  # noqa: PLC0415
    from slime_dsa.orchestrator import setup  # noqa: PLC0415
    from slime_dsa.orchestrator.rollout_manager import RolloutManager  # noqa: PLC0415

    if loop not in ("auto", "sync", "async"):
        raise ValueError(f"loop must be auto, sync or async, got {loop!r}")
    use_async = loop == "async" or (loop == "auto" and recipe.algorithm.name == "async_reinforce")
    run_dir = setup.resolve_run_dir(recipe)
    setup.write_resolved_recipe(recipe, run_dir)
    _log_to_file(run_dir)
    model_dir = setup.prepare_model_dir(recipe, run_dir)
    tokenizer = setup.load_tokenizer(recipe, model_dir)
    setup.init_ray(recipe)

    ckpts = CheckpointManager(recipe.checkpoint.dir or run_dir / "checkpoints", recipe.checkpoint.keep_last)
    ckpts.remove_orphans()
    resume_from = ckpts.latest() if resume else None
    if resume and resume_from is None:
        logger.info("resume requested but no checkpoint in %s: starting fresh", ckpts.directory)

    urls, engine_actors = await asyncio.to_thread(setup.start_engines, recipe, model_dir, use_async)
    ro = recipe.rollout
    client = EngineClient(urls, max_inflight_per_engine=max(1, ro.max_concurrency // max(1, len(urls))),
                          timeout_s=ro.request_timeout_s)
    trainers = await asyncio.to_thread(setup.start_trainers, recipe, model_dir)
    await asyncio.to_thread(setup.pin_actors, recipe, engine_actors, trainers.workers, use_async)
    weights = await asyncio.to_thread(setup.build_weight_sync, recipe, client, trainers, engine_actors, model_dir)
    tasks = build_tasks(recipe.data, tokenizer)
    manager = RolloutManager(client, tasks, TaskMixture(tasks, seed=recipe.data.seed), tokenizer, ro, seed=recipe.data.seed)

    start_step = 0
    if resume_from is not None:
        state = read_orchestrator_state(resume_from)
        await asyncio.to_thread(trainers.load_checkpoint, str(resume_from))
        manager.load_state_dict(state["rollout"])
        start_step = state["step"]
        await sync_weights(weights, version=start_step)  # engines started from the initial weights
        logger.info("resumed from %s at step %d", resume_from, start_step)
        if manager.num_pending_replays and not use_async:
            logger.warning("the checkpoint holds %d groups the asynchronous loop had started but not trained; the "
                           "synchronous loop does not regenerate them", manager.num_pending_replays)

    metrics_log = MetricsLogger(run_dir, recipe.logging.project, recipe.logging.run_name or run_dir.name,
                                recipe.logging.wandb_mode, config=recipe.model_dump(mode="json"),
                                resume_step=start_step if resume_from is not None else None)
    run = Run(recipe, run_dir, model_dir, client, trainers, manager, ckpts, metrics_log, weights, start_step,
              on_weights, hook_state)
    try:
        if on_weights is not None:
            state = await asyncio.to_thread(trainers.full_state_dict) if run.hook_wants_state(start_step) else None
            on_weights(start_step, state)
        if recipe.logging.eval_every and recipe.logging.eval_at_start and resume_from is None:
            initial = await manager.evaluate()
            metrics_log.log(initial, step=0)
            _print_step(0, recipe.trainer.num_steps, initial)
        if use_async:
            from slime_dsa.orchestrator.async_loop import run_async_loop  # noqa: PLC0415

            await run_async_loop(run)
        else:
            await _sync_loop(run)
    finally:
        metrics_log.close()
        await client.close()
        await asyncio.to_thread(_shutdown, trainers, engine_actors)
        weights.close()
    return run_dir


async def _sync_loop(run: Run) -> None:
    for step in range(run.start_step, run.recipe.trainer.num_steps):
        metrics = await _one_step(run, step)
        await after_step(run, step, metrics)


async def after_step(run: Run, step: int, metrics: dict[str, float]) -> None:
    """The tail of every RL step, in either loop: eval when due, log, print, checkpoint when due."""
    recipe = run.recipe
    if recipe.logging.eval_every and (step + 1) % recipe.logging.eval_every == 0:
        metrics.update(await run.manager.evaluate())
    if (step + 1) % recipe.logging.log_every == 0 or step + 1 == recipe.trainer.num_steps:
        run.metrics_log.log(metrics, step=step + 1)
        _print_step(step + 1, recipe.trainer.num_steps, metrics)
    save_every = recipe.checkpoint.save_every
    if (save_every and (step + 1) % save_every == 0) or step + 1 == recipe.trainer.num_steps:
        # The data position is read here, on the event loop: in the asynchronous loop the producer moves it.
        rollout_state = run.manager.state_dict()
        await asyncio.to_thread(_save_checkpoint, run.ckpts, step + 1, run.trainers, rollout_state, run.model_dir)


async def _one_step(run: Run, step: int) -> dict[str, float]:
    recipe = run.recipe
    step_start = time.perf_counter()
    groups, metrics = await run.manager.collect_step()
    samples = [s for group in groups for s in group]
    if not samples:
        logger.warning("step %d: no trainable groups (all failed or dropped); skipping the update", step + 1)
        return metrics
    # The DIS loss (async_reinforce, sao) has no π_old: a recompute would be a forward whose result nobody uses.
    old = "none" if recipe.algorithm.name in ("async_reinforce", "sao") else (
        "rollout" if recipe.algorithm.use_rollout_logprobs else "recompute")
    metrics.update(await train_on_samples(recipe, step, samples, run.trainers, old_logprobs=old, client=run.client))
    sync_time = await sync_weights(run.weights, version=step + 1, on_weights=run.on_weights,
                                   want_state=run.hook_wants_state(step + 1))
    metrics.update({"perf/sync_time_s": sync_time, "perf/step_time_s": time.perf_counter() - step_start})
    return metrics


async def train_on_samples(recipe: RecipeConfig, step: int, samples: list, trainers,
                           old_logprobs: Literal["recompute", "rollout", "none"], client=None) -> dict[str, float]:
    """trainer.num_steps_per_rollout optimiser steps on `samples`; returns train/ and perf/ metrics.

    old_logprobs: recompute = π_old from a trainer forward (and train_rollout_logprob_abs_diff from it);
    rollout = bypass, π_old := π_roll (train_rollout_logprob_abs_diff from the first optimiser step's forward);
    none = no π_old at all (DIS, whose ratio is π_θ / π_roll), and train_rollout_logprob_abs_diff is the loss's
    mean |log π_θ − log π_roll| (staleness included).
    """
    from slime_dsa.orchestrator.batching import build_train_batch, logprob_abs_diff, sample_advantages  # noqa: PLC0415

    alg = recipe.algorithm
    metrics: dict[str, float] = {}
    batch = build_train_batch(samples, sample_advantages(samples, alg.name, alg.advantage_std_normalize),
                              index_replay=alg.index_replay)
    # Colocated on GPUs: the engines hand their memory (KV pool, weights) to the trainer while it trains.
    colocated = recipe.cluster.placement == "colocated" and recipe.cluster.num_gpus_per_engine > 0
    if colocated and client is not None:
        await client.broadcast("/pause_generation", {"mode": "retract"})
        await client.broadcast("/release_memory_occupation", {"tags": ["kv_cache"]})
    train_start = time.perf_counter()
    if old_logprobs == "rollout":
        batch.old_logprobs = batch.rollout_logprobs.clone()
    recompute = old_logprobs == "recompute"
    # Metrics that cost real compute (the indexer's dense recall) only on the steps after_step logs.
    logged = (step + 1) % recipe.logging.log_every == 0 or step + 1 == recipe.trainer.num_steps
    # One call per rank: π_old (recompute) and every optimiser step of this RL step.
    old, train_metrics = await asyncio.to_thread(trainers.train, batch, recipe.trainer.num_steps_per_rollout,
                                                 recompute, logged)
    # The weight-sync check: π_old's forward when recomputed, else the first optimiser step's (same weights).
    sync_gap = train_metrics.pop("sync_logprob_abs_diff", None)
    if recompute:
        batch.old_logprobs = old
        sync_gap = logprob_abs_diff(batch)
    if sync_gap is not None and old_logprobs != "none":
        metrics["train/train_rollout_logprob_abs_diff"] = sync_gap
        if sync_gap > recipe.trainer.logprob_diff_warn_threshold:
            logger.warning("step %d: train_rollout_logprob_abs_diff %.4g exceeds %.4g: trainer and engine weights "
                           "or numerics disagree", step + 1, sync_gap, recipe.trainer.logprob_diff_warn_threshold)
    keep_loss_diff = old_logprobs == "none"
    metrics.update({f"train/{k}": v for k, v in train_metrics.items()
                    if keep_loss_diff or k != "train_rollout_logprob_abs_diff"})
    train_time = time.perf_counter() - train_start
    if colocated and client is not None:
        await client.broadcast("/resume_memory_occupation", {"tags": ["kv_cache"]})
        await client.broadcast("/continue_generation", {})
    metrics.update({"perf/train_time_s": train_time, "perf/train_tok_s": batch.num_tokens / max(train_time, 1e-9),
                    "train/num_tokens": batch.num_tokens})
    return metrics


async def sync_weights(weights, version: int, pause_mode: str = "abort",
                       on_weights: WeightsHook | None = None, want_state: bool | None = None) -> float:
    """The trainers' weights to every engine as `version` (a WeightSync); returns the seconds it took.
    on_weights gets the state dict when `want_state` (default: whenever there is a hook), else None."""
    start = time.perf_counter()
    want = on_weights is not None and want_state is not False
    state = await weights.push(version, pause_mode=pause_mode, want_state=want)
    elapsed = time.perf_counter() - start
    if on_weights is not None:
        on_weights(version, state)
    return elapsed


def _save_checkpoint(ckpts, step: int, trainers, rollout_state: dict, model_dir: Path) -> None:
    def write(tmp: Path) -> None:
        trainers.save_checkpoint(str(tmp))
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (model_dir / name).exists():
                shutil.copy2(model_dir / name, tmp / name)

    ckpts.save(step, write, {"rollout": rollout_state})


def _shutdown(trainers, engine_actors) -> None:
    import ray  # noqa: PLC0415

    try:
        trainers.shutdown()
    except Exception:  # noqa: BLE001 (shutting down: report and go on)
        logger.exception("trainer shutdown failed")
    for actor in engine_actors:
        try:
            ray.get(actor.stop.remote(), timeout=30)
        except Exception:  # noqa: BLE001
            logger.exception("engine shutdown failed")
        ray.kill(actor)


def _log_to_file(run_dir: Path) -> None:
    handler = logging.FileHandler(run_dir / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    if logging.getLogger().level > logging.INFO:
        logging.getLogger().setLevel(logging.INFO)


def _print_step(step: int, total: int, metrics: dict[str, float]) -> None:
    """One console line per step: the numbers a person watches."""
    from rich.console import Console  # noqa: PLC0415

    keys = [("rollout/reward_mean", "reward"), ("eval/pass@1", "eval pass@1"), ("train/loss", "loss"),
            ("train/train_rollout_logprob_abs_diff", "|Δlogp|"), ("perf/step_time_s", "step s")]
    parts = [f"{label} {metrics[k]:.4g}" for k, label in keys if k in metrics and not _nan(metrics[k])]
    # soft_wrap: one line per step also when stderr is a file or a narrow terminal
    Console(stderr=True, soft_wrap=True).print(f"[bold]step {step}/{total}[/bold]  " + "  ".join(parts))


def _nan(x: float) -> bool:
    return isinstance(x, float) and math.isnan(x)
