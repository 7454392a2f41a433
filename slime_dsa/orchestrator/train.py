"""`slime-dsa train`: the synchronous RL loop, rollout → train → weight sync, with eval, logging and checkpoints.

Built in the order a reader follows: run directory → model → Ray → engines → client → trainers → data → loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import shutil
import time
from pathlib import Path

from slime_dsa.config import RecipeConfig

logger = logging.getLogger(__name__)


def run_training(recipe: RecipeConfig, resume: bool = False) -> Path:
    """Run the recipe to trainer.num_steps; returns the run directory."""
    return asyncio.run(_run(recipe, resume or recipe.checkpoint.resume))


async def _run(recipe: RecipeConfig, resume: bool) -> Path:
    from rollout.client import EngineClient  # noqa: PLC0415
    from slime_dsa.checkpoint.training import CheckpointManager, read_orchestrator_state  # noqa: PLC0415
    from slime_dsa.data.prompts import TaskMixture, build_tasks  # noqa: PLC0415
    from slime_dsa.logging import MetricsLogger  # noqa: PLC0415
    from slime_dsa.orchestrator import setup  # noqa: PLC0415
    from slime_dsa.orchestrator.rollout_manager import RolloutManager  # noqa: PLC0415

    run_dir = setup.resolve_run_dir(recipe)
    setup.write_resolved_recipe(recipe, run_dir)
    _log_to_file(run_dir)
    model_dir = setup.prepare_model_dir(recipe, run_dir)
    tokenizer = setup.load_tokenizer(recipe, model_dir)
    setup.init_ray(recipe)

    ckpts = CheckpointManager(recipe.checkpoint.dir or run_dir / "checkpoints", recipe.checkpoint.keep_last)
    resume_from = ckpts.latest() if resume else None
    if resume and resume_from is None:
        logger.info("resume requested but no checkpoint in %s: starting fresh", ckpts.directory)

    urls, engine_actors = await asyncio.to_thread(setup.start_engines, recipe, model_dir)
    ro = recipe.rollout
    client = EngineClient(urls, max_inflight_per_engine=max(1, ro.max_concurrency // max(1, len(urls))),
                          timeout_s=ro.request_timeout_s)
    trainers = await asyncio.to_thread(setup.start_trainers, recipe, model_dir)
    tasks = build_tasks(recipe.data, tokenizer)
    manager = RolloutManager(client, tasks, TaskMixture(tasks, seed=recipe.data.seed), tokenizer, ro, seed=recipe.data.seed)

    start_step = 0
    if resume_from is not None:
        state = read_orchestrator_state(resume_from)
        await asyncio.to_thread(trainers.load_checkpoint, str(resume_from))
        manager.load_state_dict(state["rollout"])
        start_step = state["step"]
        await _sync_weights(client, trainers, version=start_step)  # engines started from the initial weights
        logger.info("resumed from %s at step %d", resume_from, start_step)

    metrics_log = MetricsLogger(run_dir, recipe.logging.project, recipe.logging.run_name or run_dir.name,
                                recipe.logging.wandb_mode, config=recipe.model_dump(mode="json"),
                                resume_step=start_step if resume_from is not None else None)
    try:
        for step in range(start_step, recipe.trainer.num_steps):
            metrics = await _one_step(recipe, step, manager, trainers, client)
            if recipe.logging.eval_every and (step + 1) % recipe.logging.eval_every == 0:
                metrics.update(await manager.evaluate())
            if (step + 1) % recipe.logging.log_every == 0 or step + 1 == recipe.trainer.num_steps:
                metrics_log.log(metrics, step=step + 1)
                _print_step(step + 1, recipe.trainer.num_steps, metrics)
            save_every = recipe.checkpoint.save_every
            if (save_every and (step + 1) % save_every == 0) or step + 1 == recipe.trainer.num_steps:
                await asyncio.to_thread(_save_checkpoint, ckpts, step + 1, trainers, manager, model_dir)
    finally:
        metrics_log.close()
        await client.close()
        await asyncio.to_thread(_shutdown, trainers, engine_actors)
    return run_dir


async def _one_step(recipe: RecipeConfig, step: int, manager, trainers, client) -> dict[str, float]:
    from slime_dsa.orchestrator.batching import build_train_batch, logprob_abs_diff, sample_advantages  # noqa: PLC0415

    alg = recipe.algorithm
    step_start = time.perf_counter()
    groups, metrics = await manager.collect_step()
    samples = [s for group in groups for s in group]
    if not samples:
        logger.warning("step %d: no trainable groups (all failed or dropped); skipping the update", step + 1)
        return metrics
    batch = build_train_batch(samples, sample_advantages(samples, alg.name, alg.advantage_std_normalize))

    train_start = time.perf_counter()
    if alg.use_rollout_logprobs:
        batch.old_logprobs = batch.rollout_logprobs.clone()
    else:
        batch.old_logprobs = await asyncio.to_thread(trainers.compute_logprobs, batch)
        diff = logprob_abs_diff(batch)
        metrics["train/train_rollout_logprob_abs_diff"] = diff
        if diff > recipe.trainer.logprob_diff_warn_threshold:
            logger.warning("step %d: train_rollout_logprob_abs_diff %.4g exceeds %.4g: trainer and engine weights "
                           "or numerics disagree", step + 1, diff, recipe.trainer.logprob_diff_warn_threshold)
    train_metrics = await asyncio.to_thread(trainers.train_step, batch)
    metrics.update({f"train/{k}": v for k, v in train_metrics.items() if k != "train_rollout_logprob_abs_diff"})
    train_time = time.perf_counter() - train_start

    sync_time = await _sync_weights(client, trainers, version=step + 1)
    metrics.update({
        "perf/train_time_s": train_time, "perf/sync_time_s": sync_time,
        "perf/train_tok_s": batch.num_tokens / max(train_time, 1e-9),
        "perf/step_time_s": time.perf_counter() - step_start, "train/num_tokens": batch.num_tokens,
    })
    return metrics


async def _sync_weights(client, trainers, version: int) -> float:
    from slime_dsa.orchestrator.weight_sync import push_weights  # noqa: PLC0415

    start = time.perf_counter()
    state = await asyncio.to_thread(trainers.full_state_dict)
    await push_weights(client, state, version)
    return time.perf_counter() - start


def _save_checkpoint(ckpts, step: int, trainers, manager, model_dir: Path) -> None:
    def write(tmp: Path) -> None:
        trainers.save_checkpoint(str(tmp))
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (model_dir / name).exists():
                shutil.copy2(model_dir / name, tmp / name)

    ckpts.save(step, write, {"rollout": manager.state_dict()})


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
    Console(stderr=True).print(f"[bold]step {step}/{total}[/bold]  " + "  ".join(parts))


def _nan(x: float) -> bool:
    return isinstance(x, float) and math.isnan(x)
