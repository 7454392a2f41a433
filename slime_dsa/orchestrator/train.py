"""`slime-dsa train`: builds a run and drives the loop its algorithm declares. The synchronous loop (rollout →
train → weight sync) lives here; the asynchronous one in async_loop.py; both share step.py.

Built in the order a reader follows: run directory → model → Ray → engines → client → teachers (on-policy
distillation) → trainers → data → loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from slime_dsa import interrupts
from slime_dsa.algorithms.specs import build_algorithm
from slime_dsa.config import RecipeConfig
from slime_dsa.config.errors import UserError
from slime_dsa.gc_watch import frozen_during
from slime_dsa.orchestrator.async_loop import run_async_loop
from slime_dsa.orchestrator.profile import PhaseClock, StepProfiler
from slime_dsa.orchestrator.step import (
    HookState, Run, StepProgress, WeightsHook, after_step, emergency_checkpoint, ensure_engines, print_step,
    probe_engines, sync_weights, train_on_samples,
)

logger = logging.getLogger(__name__)
UNPLACED_WARNING_S = 120.0  # start-up of engines and trainer ranks that takes longer: warned
FAILED_STEPS_LIMIT = 3  # steps in a row with every sample failed, after which the run stops (check_failed_steps)


def run_training(recipe: RecipeConfig, resume: bool = False, loop: Literal["auto", "sync", "async"] = "auto",
                 on_weights: WeightsHook | None = None, hook_state: HookState = "every") -> Path:
    """Run the recipe to trainer.num_steps; returns the run directory.

    loop: auto = the loop the algorithm declares; sync/async force one (comparisons of the two on one recipe).
    on_weights, hook_state: see WeightsHook.
    """
    if hook_state not in ("every", "last"):
        raise ValueError(f"hook_state must be every or last, got {hook_state!r}")
    if loop not in ("auto", "sync", "async"):
        raise ValueError(f"loop must be auto, sync or async, got {loop!r}")
    from slime_dsa.run_dir import locked_checkpoint_dir, open_run_dir, with_absolute_paths  # noqa: PLC0415

    progress = StepProgress()
    recipe = with_absolute_paths(recipe)
    with open_run_dir(recipe, "train.log") as run_dir, locked_checkpoint_dir(checkpoint_dir(recipe, run_dir)):
        try:
            return interrupts.run(_run(recipe, run_dir, resume or recipe.checkpoint.resume, loop, on_weights,
                                       hook_state, progress))
        except KeyboardInterrupt:
            line = progress.lost_line(checkpoint_dir(recipe, run_dir)) if progress.current else progress.waiting
            logger.info("interrupted%s", f": {line}" if line else "")  # the console gets the command's one line
            raise KeyboardInterrupt(line) from None


def checkpoint_dir(recipe: RecipeConfig, run_dir: Path) -> Path:
    """checkpoint.dir, else run_dir/checkpoints."""
    return Path(recipe.checkpoint.dir) if recipe.checkpoint.dir else run_dir / "checkpoints"


async def _run(recipe: RecipeConfig, run_dir: Path, resume: bool, loop: str = "auto",
               on_weights: WeightsHook | None = None, hook_state: HookState = "every",
               progress: StepProgress | None = None) -> Path:
    from rollout.client import EngineClient  # noqa: PLC0415
    from rollout.recipe_plugins import check_recipe_plugins  # noqa: PLC0415
    from slime_dsa.checkpoint.training import read_orchestrator_state  # noqa: PLC0415
    from slime_dsa.data.prompts import TaskMixture, build_tasks  # noqa: PLC0415
    from slime_dsa.logging import MetricsLogger  # noqa: PLC0415
    from slime_dsa.orchestrator import cluster, setup  # noqa: PLC0415
    from slime_dsa.orchestrator.perf import EngineStats, train_flops_for_run  # noqa: PLC0415
    from slime_dsa.orchestrator.rollout_manager import RolloutManager  # noqa: PLC0415
    from slime_dsa.run_dir import load_tokenizer, prepare_model_dir, tokenizer_size  # noqa: PLC0415
    from slime_dsa.orchestrator.weight_sync import (  # noqa: PLC0415
        build_weight_sync, engine_weight_dirs, remove_stale_shm_dirs, shm_dir_name,
    )

    algorithm = build_algorithm(recipe.algorithm)
    cluster.check_local_gpus(recipe)
    use_async = loop == "async" or (loop == "auto" and algorithm.loop == "async")
    if use_async and recipe.logging.profile_steps:
        raise UserError("logging.profile_steps needs the synchronous loop, and this run uses the asynchronous one")
    if use_async and recipe.rollout.prefetch_next_step:
        raise UserError("rollout.prefetch_next_step applies to the synchronous loop, and this run uses the "
                        "asynchronous one")
    progress = progress or StepProgress()
    ckpts, resume_from = _checkpoints(recipe, run_dir, resume)
    model_dir = prepare_model_dir(recipe, run_dir)
    if resume_from is not None:
        check_same_model(resume_from, model_dir)
    tokenizer = load_tokenizer(recipe, model_dir)
    _check_critic_and_teacher_dirs(recipe, tokenizer_size(tokenizer))  # highest id + 1: the rows it looks up
    if recipe.teachers:
        from slime_dsa.orchestrator.teachers import check_tokenizers, model_logits  # noqa: PLC0415

        check_tokenizers(recipe.teachers, tokenizer, model_logits(model_dir))  # before anything slow starts
    check_recipe_plugins(recipe)  # a plugin that does not resolve: before the prompts, Ray
    if recipe.rollout.engine == "external":
        # the key the run's client will send: a wrong one is one line here, not a run of skipped steps
        key = setup.EngineAccess.for_run(recipe, []).api_key
        await setup.check_external_engines(list(recipe.rollout.engine_urls), key)
    tasks = build_tasks(recipe.data, tokenizer)  # a malformed dataset row fails here, before Ray and the engines
    saved_state = read_orchestrator_state(resume_from) if resume_from is not None else None
    if saved_state is not None:  # data.tasks or data.seed changed since the checkpoint: refused before Ray starts
        TaskMixture(tasks, seed=recipe.data.seed).load_state_dict(saved_state["rollout"]["mixture"])
    # W&B's check (online: a key, its server) before Ray, the engines and the trainer ranks start, not minutes after
    metrics_log = MetricsLogger(run_dir, recipe.logging.project, recipe.logging.run_name or run_dir.name,
                                recipe.logging.wandb_mode, config=recipe.model_dump(mode="json"),
                                resume_step=metrics_resume_step(resume, resume_from,
                                                                saved_state["step"] if saved_state else 0))
    trainers = teachers = client = fleet = weights = None
    engine_actors: list = []
    try:
        cluster.init_ray(recipe)
        cluster.check_cluster_fits(recipe)  # a joined cluster too small: one line, not a silent wait
        cluster.check_nodes_share_paths(recipe, model_dir, run_dir, checkpoint_dir(recipe, run_dir))
        remove_stale_shm_dirs()  # model-sized copies left in /dev/shm by runs that were SIGKILLed
        shm_dir = shm_dir_name()
        access = setup.EngineAccess.for_run(recipe, engine_weight_dirs(run_dir, shm_dir), cluster.engine_host(recipe))

        urls, engine_actors, teachers, pool, trainers = await _start_actors(recipe, model_dir, use_async, access,
                                                                           run_dir, algorithm, tokenizer, progress)
        ro = recipe.rollout
        concurrency = recipe.max_concurrency(use_async)
        logger.info("%s", recipe.concurrency_line(use_async))
        client = EngineClient(urls, max_inflight_per_engine=max(1, concurrency // max(1, len(urls))),
                              timeout_s=ro.request_timeout_s, api_key=access.api_key, coalesce=ro.client_coalesce())
        await asyncio.to_thread(setup.pin_actors, recipe, engine_actors, trainers.workers, use_async)
        weights = await asyncio.to_thread(build_weight_sync, recipe, client, trainers, engine_actors, model_dir,
                                          run_dir, shm_dir)
        fleet = _watch_engines(recipe, client, dict(zip(urls, engine_actors)), weights.name, model_dir, use_async,
                               access, run_dir)
        manager = RolloutManager(client, tasks, TaskMixture(tasks, seed=recipe.data.seed), tokenizer, ro,
                                 seed=recipe.data.seed, min_group_size=algorithm.min_group_size,
                                 max_concurrency=concurrency, teachers=pool)

        start_step = 0
        if resume_from is not None:
            await asyncio.to_thread(trainers.load_checkpoint, str(resume_from))
            manager.load_state_dict(saved_state["rollout"])
            start_step = progress.saved = progress.trained = saved_state["step"]
            await _push_start_weights(recipe, weights, start_step, resume_from, fleet, client)
            logger.info("resumed from %s at step %d", resume_from, start_step)
            if manager.num_pending_replays and not use_async:
                logger.warning("the checkpoint holds %d groups the asynchronous loop had started but not trained; the "
                               "synchronous loop does not regenerate them", manager.num_pending_replays)
            elif manager.num_pending_replays:
                # They are prompts, not tokens: a resume may change the bound on staleness and it holds at once.
                logger.info("the checkpoint holds %d groups started and not trained: they are generated again first, "
                            "under its weights (no token of theirs is kept, so algorithm.max_staleness %d applies to "
                            "them as to new ones)", manager.num_pending_replays, recipe.algorithm.max_staleness)
        elif ro.engine == "external":  # servers the run did not start hold whatever they loaded last (another run's)
            await _push_start_weights(recipe, weights, 0, model_dir, fleet, client)

        run = Run(recipe, algorithm, run_dir, model_dir, client, trainers, manager, ckpts, metrics_log, weights,
                  start_step, on_weights, hook_state, pool, progress, fleet, EngineStats(client),
                  await asyncio.to_thread(train_flops_for_run, recipe, model_dir, trainers))
    except BaseException:
        metrics_log.close()  # the W&B run of a start-up that failed ends as failed
        await _stop_started(trainers, engine_actors, teachers, fleet, client, weights)
        raise
    try:
        if on_weights is not None:
            state = await asyncio.to_thread(trainers.full_state_dict) if run.hook_wants_state(start_step) else None
            on_weights(start_step, state)
        if recipe.logging.eval_every and recipe.logging.eval_at_start and resume_from is None:
            initial = await manager.evaluate()
            metrics_log.log(initial, step=0)
            print_step(0, recipe.trainer.num_steps, initial)
        await run.engine_stats.reset()  # perf/engine_* of step 1 count from here
        # The driver's start-up objects (tokenizer, datasets, Ray's client, a calling script's own) leave its full
        # collections: each one scans every tracked object, and one stops the event loop mid-step.
        with frozen_during("driver") as run.driver_gc:
            if use_async:
                await run_async_loop(run)
            else:
                await _sync_loop(run)
    except Exception as e:
        line = await _failure_line(run, e)
        if line is None:
            raise
        raise UserError(line) from None
    finally:
        metrics_log.close()
        await _stop_started(trainers, engine_actors, teachers, fleet, client, weights)
    return run_dir


async def _stop_started(trainers: Any, engine_actors: list, teachers: Any, fleet: Any, client: Any,
                        weights: Any) -> None:
    """Stop what the run started (None: not started yet): a start-up that failed left its actors holding the
    cluster's resources, so that a later run in the same process waited for them."""
    if fleet is not None:
        await fleet.close()
    if client is not None:
        await client.close()
    if teachers is not None:
        await teachers.close()
    if trainers is not None or engine_actors:
        await asyncio.to_thread(_shutdown, trainers, fleet.all_actors() if fleet is not None else engine_actors)
    if weights is not None:
        weights.close()


async def _start_actors(recipe: RecipeConfig, model_dir: Path, use_async: bool, access: Any, run_dir: Path,
                        algorithm: Any, tokenizer: Any, progress: StepProgress) -> tuple[list[str], list, Any, Any,
                                                                                        Any]:
    """(engine URLs, engine actors, teachers, their pool, trainer group), the Ray actors of the run started. Engines
    and trainer ranks start side by side (the ranks compile their kernels meanwhile), except SGLang servers, which size
    their memory pools from the GPU memory free when they start. An interruption (Ctrl-C, SIGTERM) while Ray has not
    placed some of them ends their waits, and progress.waiting says what the run waited for."""
    from slime_dsa.orchestrator import cluster, setup  # noqa: PLC0415
    from trainers.factory import build_trainer_group  # noqa: PLC0415

    # Ray waits silently for resources that other jobs hold: say so once if the actors take that long
    unplaced = asyncio.get_running_loop().call_later(UNPLACED_WARNING_S, cluster.warn_unplaced, recipe)
    try:
        engines_up = asyncio.to_thread(setup.start_engines, recipe, model_dir, use_async, access, run_dir)
        if recipe.rollout.engine == "sglang":
            (urls, engine_actors), trainers_up = await engines_up, None
        else:
            trainers_up = asyncio.ensure_future(asyncio.to_thread(build_trainer_group, recipe, model_dir, algorithm))
            try:
                urls, engine_actors = await engines_up
            except Exception:  # an error, not an interruption: ranks that Ray has not placed would be waited for ever
                await asyncio.gather(trainers_up, return_exceptions=True)  # no rank left starting behind the error
                raise
        teachers, pool = None, None
        if recipe.teachers:
            from slime_dsa.orchestrator.teachers import Teachers  # noqa: PLC0415

            teachers = Teachers(recipe, recipe.rollout.temperature or 1.0, algorithm.teacher_topk, access.host)
            pool = await teachers.start(tokenizer.encode("Compute 1 + 1."))
        trainers = await (trainers_up or asyncio.to_thread(build_trainer_group, recipe, model_dir, algorithm))
    except asyncio.CancelledError:  # Ctrl-C or SIGTERM: the threads waiting in ray.get would keep the process alive
        progress.waiting = cluster.stop_unplaced(recipe)
        raise
    finally:
        unplaced.cancel()
    return urls, engine_actors, teachers, pool, trainers


async def _push_start_weights(recipe: RecipeConfig, weights: Any, step: int, source: Path, fleet: Any,
                              client: Any) -> None:
    """The weights the run starts from (`source`: the checkpoint resumed, or the initial model for external engines)
    to the engines as version `step`; a refusal is one UserError (the fleet and the client closed first, so nothing
    but that line reaches the console)."""
    from slime_dsa.config.errors import UserError  # noqa: PLC0415
    from slime_dsa.orchestrator.weight_sync.base import WeightUpdateRefusedError  # noqa: PLC0415

    try:
        await sync_weights(weights, version=step)
    except WeightUpdateRefusedError as e:
        await fleet.close()
        await client.close()
        hint = _refusal_hint(recipe, weights)
        raise UserError(f"the engines refused the weights of {source}: {e}{hint}") from None


async def _failure_line(run: Run, error: Exception) -> str | None:
    """One line for a failure the run cannot go on after, or None for a bug: every engine lost (an emergency
    checkpoint is written first), a trainer rank dead (a Ray actor's process died under a call: in the loop, a
    trainer rank; engines are reached over HTTP), or a weight update the engines refused."""
    from ray.exceptions import RayActorError, RayTaskError  # noqa: PLC0415

    from rollout.client import EngineLossError  # noqa: PLC0415
    from slime_dsa.orchestrator.weight_sync.base import WeightUpdateRefusedError  # noqa: PLC0415

    step = run.progress.current
    if isinstance(error, EngineLossError):
        saved = await emergency_checkpoint(run)
        where = f"emergency checkpoint {saved}; --resume continues from it" if saved else "no step to checkpoint"
        return f"rollout engines lost at step {step}: {error}; {where}"
    newest = run.ckpts.latest()
    where = f"the newest checkpoint is {newest}; --resume continues from it" if newest else "no checkpoint yet"
    if isinstance(error, RayActorError):
        return f"a trainer rank died at step {step} ({type(error).__name__}); {where}"
    if isinstance(error, RayTaskError) and (dead := await asyncio.to_thread(_dead_rank, run.trainers)):
        return f"a trainer rank died at step {step} ({dead}); {where}"
    if isinstance(error, WeightUpdateRefusedError):
        hint = _refusal_hint(run.recipe, run.weights)
        return f"the engines refused the weights of step {step}: {error}{hint}; {where}"
    return None


def _dead_rank(trainers: Any, timeout_s: float = 10.0) -> str | None:
    """The error Ray gives for a trainer rank whose process is gone, or None when every rank answers: a live rank's
    collective fails when a peer dies (gloo: "Connection closed by peer"), and that error may reach the driver first."""
    import ray  # noqa: PLC0415
    from ray.exceptions import GetTimeoutError, RayActorError  # noqa: PLC0415

    for worker in getattr(trainers, "workers", []):
        try:
            ray.get(worker.__ray_ready__.remote(), timeout=timeout_s)
        except RayActorError as e:
            return type(e).__name__
        except GetTimeoutError:  # alive, busy
            continue
    return None


def _refusal_hint(recipe: RecipeConfig, weights: Any) -> str:
    """What to change when external engines refused weights from a directory: a `slime-dsa serve` engine loads only
    from its --weight-dir."""
    directory = getattr(weights, "directory", None)
    if recipe.rollout.engine != "external" or directory is None:
        return ""
    return (f" (they load them from {directory}: start `slime-dsa serve` with --weight-dir {Path(directory).parent}, "
            "or set rollout.weight_sync http)")


def _watch_engines(recipe: RecipeConfig, client: Any, actors: dict[str, Any], transport: str, model_dir: Path,
                   use_async: bool, access: Any, run_dir: Path | None = None) -> Any:
    """The run's EngineFleet, watching `actors`; it replaces lost engines, and re-admits lost external servers that
    answer again, when rollout.restart_dead_engines allows (never for the distributed transport, whose NCCL group
    cannot take a new member)."""
    from slime_dsa.orchestrator.engines import EngineFleet  # noqa: PLC0415

    restart = recipe.rollout.restart_dead_engines and transport != "distributed"
    external = list(recipe.rollout.engine_urls) if recipe.rollout.engine == "external" and restart else []
    fleet = EngineFleet(client, actors,
                        _restarter(recipe, model_dir, use_async, access, run_dir, len(actors)) if restart else None,
                        readmit=external)
    fleet.start()
    return fleet


def _restarter(recipe: RecipeConfig, model_dir: Path, use_async: bool, access, run_dir: Path | None = None,
               started: int = 0) -> Any:
    """start_one for the EngineFleet: one new engine actor as the recipe asks, started; (url, actor). Each logs to
    the next engine_<i>.log after the `started` engines' of the run directory."""
    import itertools  # noqa: PLC0415

    from rollout.actors import start_engine_actors  # noqa: PLC0415
    from slime_dsa.orchestrator import setup  # noqa: PLC0415

    numbers = itertools.count(started)

    def start_one() -> tuple[str, Any]:
        (actor,) = setup.create_engines(recipe, model_dir, use_async, access, 1, run_dir, next(numbers))
        (url,) = start_engine_actors([actor], timeout_s=600)
        return url, actor

    return start_one


def metrics_resume_step(resume: bool, resume_from: Path | None, start_step: int) -> int | None:
    """The step past which metrics.jsonl's old records are dropped: the resumed step; all of them (-1) when a resume
    found no checkpoint and starts fresh (they are of steps it will run again); None (append) for a new run."""
    if resume_from is not None:
        return start_step
    return -1 if resume else None


def _checkpoints(recipe: RecipeConfig, run_dir: Path, resume: bool) -> tuple[Any, Path | None]:
    """(the run's CheckpointManager, the checkpoint to resume from or None): orphans of killed saves removed under the
    lock; a finished run refused in one line."""
    from slime_dsa.checkpoint.training import CheckpointManager  # noqa: PLC0415

    ckpts = CheckpointManager(checkpoint_dir(recipe, run_dir), recipe.checkpoint.keep_last)
    with checkpoints_locked(run_dir, ckpts.directory) as lock:
        ckpts.remove_orphans(lock)
    resume_from = ckpts.latest() if resume else None
    if resume and resume_from is None:
        refuse_damaged_only(ckpts)
        logger.warning("resume requested but no checkpoint in %s: starting fresh", ckpts.directory)
    if resume_from is not None:
        check_not_finished(recipe, resume_from)
        check_checkpoint_layout(recipe, resume_from)
        check_rollout_state(resume_from)
    return ckpts, resume_from


def refuse_damaged_only(ckpts: Any) -> None:
    """UserError (one line) when `ckpts` holds checkpoints and none is intact: starting afresh would overwrite them
    with its own saves and drop metrics.jsonl's records."""
    from slime_dsa.checkpoint.validate import checkpoint_problem  # noqa: PLC0415
    from slime_dsa.config.errors import UserError  # noqa: PLC0415

    if found := ckpts.checkpoints():
        raise UserError(f"--resume: no intact checkpoint in {ckpts.directory} (the newest, {found[-1]}: "
                        f"{checkpoint_problem(found[-1])}); repair it, or move the checkpoints away to start afresh")


def check_rollout_state(checkpoint: Path) -> None:
    """UserError (one line) when `checkpoint`'s orchestrator.json lacks the rollout state a resume reads (edited by
    hand): it passes validation, which needs only its step."""
    from slime_dsa.checkpoint.training import read_orchestrator_state  # noqa: PLC0415
    from slime_dsa.config.errors import UserError  # noqa: PLC0415

    rollout = read_orchestrator_state(checkpoint).get("rollout")
    keys = ("mixture", "next_sample_index", "next_group_id")  # what RolloutManager.load_state_dict reads
    missing = [k for k in keys if not isinstance(rollout, dict) or k not in rollout]
    if missing:
        raise UserError(f"{Path(checkpoint) / 'orchestrator.json'} holds no rollout.{missing[0]}, which a resume "
                        "reads (edited by hand?): restore it, or move this checkpoint away to resume from the one "
                        "before")


def check_same_model(checkpoint: Path, model_dir: Path) -> None:
    """UserError (one line, naming the tensor) when `checkpoint`'s weights do not fit this run's model (model.path or
    model.preset changed since): the trainer ranks' load failed with a long traceback once Ray, engines and ranks ran."""
    from slime_dsa.checkpoint.validate import model_mismatch  # noqa: PLC0415
    from slime_dsa.config.errors import UserError  # noqa: PLC0415

    if problem := model_mismatch(Path(checkpoint), Path(model_dir)):
        raise UserError(f"{checkpoint}: {problem} ({model_dir}): resume with the model.path or model.preset the run "
                        "was trained from")


def check_not_finished(recipe: RecipeConfig, checkpoint: Path) -> None:
    """UserError (one line) when `checkpoint` is already at trainer.num_steps: resuming would train nothing."""
    from slime_dsa.checkpoint.training import read_orchestrator_state  # noqa: PLC0415
    from slime_dsa.config.errors import UserError  # noqa: PLC0415

    step, total = read_orchestrator_state(checkpoint)["step"], recipe.trainer.num_steps
    if step >= total:
        raise UserError(f"the run is already at step {step} of trainer.num_steps {total} ({checkpoint}): nothing to "
                        f"resume; to train further, raise trainer.num_steps (e.g. --resume --set "
                        f"trainer.num_steps={max(2 * total, step + 1)})")


def check_checkpoint_layout(recipe: RecipeConfig, checkpoint: Path) -> None:
    """UserError (one line) when the trainer ranks could not read `checkpoint`: Megatron's per-rank shards
    (megatron/rank{r}.json, for the same ranks and sizes) against fsdp's and deepspeed's full tensors. A warning when
    fsdp or deepspeed resume full tensors with another number of ranks, which works but is not exact."""
    from slime_dsa.config.errors import UserError  # noqa: PLC0415

    backend, rank0 = recipe.trainer.backend, checkpoint / "megatron" / "rank0.json"
    if rank0.is_file() != (backend == "megatron"):
        wrote = "megatron" if rank0.is_file() else "fsdp or deepspeed"
        raise UserError(f"{checkpoint} was written by trainer.backend {wrote}, and this run's trainer.backend is "
                        f"'{backend}': resume with the backend that wrote it, or start a new run from its weights "
                        f"(model.path {checkpoint})")
    if backend == "megatron":
        saved = json.loads(rank0.read_text())
        now = {"world_size": recipe.trainer.num_workers, "sizes": recipe.trainer.megatron.model_dump()}
        if {k: saved.get(k) for k in now} != now:
            raise UserError(f"{checkpoint} was written by {saved.get('world_size')} ranks with trainer.megatron "
                            f"{saved.get('sizes')}; this run has trainer.num_workers {now['world_size']} and "
                            f"{now['sizes']}: resume with the same ones")
        return
    written_by = len(list(checkpoint.glob("rng_rank*.safetensors")))  # one per policy rank (fsdp, deepspeed)
    if written_by and written_by != recipe.trainer.num_workers:
        logger.warning("%s was written by %d trainer ranks and this run has trainer.num_workers %d: it resumes from "
                       "the same weights and optimizer state, but not exactly (the batch splits across ranks "
                       "differently, and a rank without a saved RNG stream starts a fresh one)", checkpoint,
                       written_by, recipe.trainer.num_workers)


@contextmanager
def checkpoints_locked(run_dir: Path, ckpt_dir: Path) -> Iterator[Any]:
    """The lock that covers `ckpt_dir`: its own or the run directory's, held for the run (run_training), or else a
    lock of its own held for the block."""
    from slime_dsa.run_dir import held_lock  # noqa: PLC0415
    from slime_dsa.run_lock import RunLock  # noqa: PLC0415

    lock = held_lock(ckpt_dir) or held_lock(run_dir)  # the first held by run_training for the whole run
    if lock is not None and ckpt_dir.resolve().is_relative_to(Path(lock.run_dir).resolve()):
        yield lock
        return
    with RunLock(ckpt_dir, key="checkpoint.dir") as own:
        yield own


async def _sync_loop(run: Run) -> None:
    logs = run.recipe.logging
    profiler = StepProfiler(logs.profile_steps, run.run_dir, run.client, run.trainers, logs.profile_activities)
    try:
        for step in range(run.start_step, run.recipe.trainer.num_steps):
            interrupts.raise_if_terminated()
            run.progress.current = step + 1
            async with profiler.window(step + 1) as clock:
                metrics = await _one_step(run, step, clock)
                await after_step(run, step, metrics)
                clock.mark("log")
    finally:
        run.manager.cancel_prefetch()  # a step that failed after its train call sent the next one's round


def check_failed_steps(run: Run, step: int, metrics: dict[str, float]) -> None:
    """Count the steps in a row whose every sample failed; at FAILED_STEPS_LIMIT stop the run with the error one of
    them got. One failed sample costs that sample, but engines that fail every request (a CUDA error that outlives
    its batch, out of memory) would otherwise skip step after step with nothing trained."""
    generated = int(metrics.get("rollout/num_samples", 0))
    failed = int(metrics.get("rollout/failed_samples", 0))
    run.failed_steps = run.failed_steps + 1 if generated and failed == generated else 0
    if run.failed_steps >= FAILED_STEPS_LIMIT:
        error = run.manager.collector.last_error or "no error message"
        raise UserError(f"steps {step - run.failed_steps + 1}-{step}: every sample failed ({generated} in step {step}; "
                        f"e.g. {error}); the engines generate nothing, so the run stops here (engine_*.log in the "
                        "run directory has their tracebacks)")


def skipped_step_line(step: int, metrics: dict[str, float], dynamic_sampling: bool) -> str:
    """Why a synchronous step has no group to train on, from its rollout/ counts."""
    uniform = int(metrics.get("rollout/zero_std_groups", 0))
    why = [f"{uniform} whose rewards all agree (no advantage; dropped by rollout.dynamic_sampling)"] \
        if dynamic_sampling and uniform else []
    why.append(f"{int(metrics.get('rollout/dropped_groups', 0))} with too few usable samples")
    why.append(f"{int(metrics.get('rollout/failed_samples', 0))} samples failed")
    return f"step {step}: no group to train on ({', '.join(why)}); skipping the update"


async def _one_step(run: Run, step: int, clock: PhaseClock | None = None) -> dict[str, float]:
    """One synchronous RL step: rollout, training, weight push; its metrics. clock: marks its phases (profile.py)."""
    clock = clock or PhaseClock()
    step_start = time.perf_counter()
    await ensure_engines(run, version=step)
    clock.mark("engines")
    groups, metrics = await run.manager.collect_step()
    clock.mark("rollout")
    samples = [s for group in groups for s in group]
    check_failed_steps(run, step + 1, metrics)
    if not samples:
        logger.warning("%s", skipped_step_line(step + 1, metrics, run.recipe.rollout.dynamic_sampling))
        await probe_engines(run)  # were the engines lost? (NoEnginesLeftError when all are)
        return metrics
    # The push right after training continues the engines, colocated ones included (paused while the trainer stepped).
    rollout_state = run.manager.state_dict()  # the data position before a prefetch takes the next step's prompts
    prefetch = prefetches(run.recipe, step, hold_s=run.last_hold_s)
    _warn_once_if_held_back(run, step)
    metrics.update(await train_on_samples(run, step, samples, resume_engines=False, clock=clock,
                                          while_training=(lambda: _prefetch_next_round(run)) if prefetch else None))
    run.progress.mark_trained(step + 1, rollout_state)
    # A prefetched round waits in the engines' queues: the push's pause keeps it (retract) where abort would end it.
    sync_time = await sync_weights(run.weights, version=step + 1, pause_mode="retract" if prefetch else "abort",
                                   on_weights=run.on_weights, want_state=run.hook_wants_state(step + 1),
                                   fleet=run.fleet)
    clock.mark("sync")
    run.last_hold_s = metrics.get("perf/train_time_s", 0.0) + sync_time
    if run.engine_stats is not None:
        # The push's replies serve as after_step's read of the engines' stats: they hold this step's alone (nothing
        # else runs there before the push continues them, and then only a prefetched round of the next step).
        run.engine_stats.offer(getattr(run.weights, "last_replies", None))
    # The read-back of the weights for an on_weights hook (a benchmark's) is in sync_time; said apart, so it can be
    # taken out of what the step costs a run without one.
    metrics.update({"perf/sync_time_s": sync_time, "perf/step_time_s": time.perf_counter() - step_start,
                    "perf/weights_readback_s": getattr(run.weights, "last_read_s", 0.0)})
    return metrics


def prefetches(recipe: RecipeConfig, step: int, hold_s: float = 0.0) -> bool:
    """Whether step `step`'s train call sends step + 1's first round (rollout.prefetch_next_step): never before an
    evaluation, a checkpoint or the end, whose sample numbering and data position must not hold the next step's, nor
    when the last train call and push (`hold_s`) took too long for the calls' timeout (`prefetch_fits`)."""
    if not recipe.rollout.prefetch_next_step or step + 1 >= recipe.trainer.num_steps:
        return False
    if not prefetch_fits(hold_s, recipe.rollout.request_timeout_s):
        return False
    eval_every, save_every = recipe.logging.eval_every, recipe.checkpoint.save_every
    return not (eval_every and (step + 1) % eval_every == 0) and not (save_every and (step + 1) % save_every == 0)


def prefetch_fits(hold_s: float, request_timeout_s: float) -> bool:
    """Whether prefetched calls, which wait through a train call and a push, would keep half their timeout: judged
    by the last step's (`hold_s`), so a run whose steps outgrow it stops prefetching instead of losing its calls."""
    return hold_s <= 0.5 * request_timeout_s


def _warn_once_if_held_back(run: Run, step: int) -> None:
    """Say once a run that a step does not prefetch for its hold (perf/rollout_prefetched says which steps)."""
    timeout_s = run.recipe.rollout.request_timeout_s
    if run.prefetch_held_back or not run.recipe.rollout.prefetch_next_step \
            or prefetch_fits(run.last_hold_s, timeout_s):
        return
    run.prefetch_held_back = True
    logger.warning("step %d: rollout.prefetch_next_step held back: the last train call and push took %.0f s, more "
                   "than half of rollout.request_timeout_s (%.0f s), which the prefetched calls wait through (it "
                   "resumes when they are shorter again)", step + 1, run.last_hold_s, timeout_s)


async def _prefetch_next_round(run: Run) -> None:
    """Step N + 1's first round to the engines, held there until the push after this train call continues them."""
    if not run.recipe.cluster.engines_take_turns():  # colocated engines are paused for the trainer already
        await run.client.broadcast("/pause_generation", {"mode": "retract"})
    run.manager.prefetch_step()


def _shutdown(trainers, engine_actors) -> None:
    import ray  # noqa: PLC0415
    from ray.exceptions import RayActorError  # noqa: PLC0415

    try:
        if trainers is not None:
            trainers.shutdown()
    except RayActorError as e:  # a rank already dead (the failure the run reports): one line, no traceback
        logger.warning("trainer shutdown: a rank was already gone (%s)", type(e).__name__)
    except Exception:  # noqa: BLE001 (shutting down: report and go on)
        logger.exception("trainer shutdown failed")
    for actor in engine_actors:
        try:
            ray.get(actor.stop.remote(), timeout=30)
        except RayActorError as e:  # already gone (killed, or the cluster died): one line, no traceback
            logger.warning("engine shutdown: an engine was already gone (%s)", type(e).__name__)
        except Exception:  # noqa: BLE001
            logger.exception("engine shutdown failed")
        ray.kill(actor)


def _check_critic_and_teacher_dirs(recipe: RecipeConfig, num_tokens: int) -> None:
    """critic.path and the teachers our engines load (serving embedded, swap): one line naming the key for a
    directory of another architecture, without weights, a critic with fewer embeddings than the tokenizer's
    `num_tokens`, or a teacher that is a value model; before Ray starts, where a trainer rank or a teacher's engine
    failed with a traceback."""
    from slime_dsa.config.errors import UserError  # noqa: PLC0415
    from slime_dsa.orchestrator.teachers import model_logits  # noqa: PLC0415
    from slime_dsa.run_dir import check_model_dir  # noqa: PLC0415

    if recipe.critic.path is not None:  # set only where the algorithm has a critic (the schema refuses it elsewhere)
        check_model_dir(Path(recipe.critic.path), "critic.path", policy=False)
        vocab = model_logits(Path(recipe.critic.path))
        if vocab is not None and vocab < num_tokens:
            raise UserError(f"critic.path: {recipe.critic.path} has {vocab} token embeddings, fewer than the "
                            f"tokenizer's {num_tokens} tokens: the value model reads the policy's token ids")
    for i, teacher in enumerate(recipe.teachers):
        if teacher.serving in ("embedded", "swap"):  # SGLang and external servers load their own architectures
            check_model_dir(Path(teacher.path), f"teachers.{i}.path")
