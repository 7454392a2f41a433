"""What both RL loops share: the Run they drive, one step's training, the weight sync, and the per-step tail
(eval, log, checkpoint). The synchronous loop is in train.py, the asynchronous one in async_loop.py."""

from __future__ import annotations

import asyncio
import logging
import math
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from slime_dsa.algorithms.specs import Algorithm, OldLogprobs
from slime_dsa.config import RecipeConfig
from slime_dsa.durable import write_problem
from slime_dsa.orchestrator.profile import PhaseClock
from trainers.base import CALL_METRIC_PREFIXES

logger = logging.getLogger(__name__)

# Called with (weight version, full state dict) each time the engines get new weights, and once with the
# starting weights; benchmarks use it to evaluate every version after the run, off the clock. With
# hook_state "last" the state dict comes with the last version only (None before it): reading the weights back
# cost the push ~0.5 s a step for a 160M-parameter model on an H200, which a benchmark timing steps must not add.
WeightsHook = Callable[[int, dict | None], None]
HookState = Literal["every", "last"]


@dataclass
class StepProgress:
    """How far a run got: the step in progress and the last one checkpointed (both 1-based), for what an
    interruption loses."""

    current: int = 0  # the step being run (0 before the first)
    saved: int = 0  # the step of the newest checkpoint written or resumed from (0: none)
    trained: int = 0  # the last step whose optimiser steps are done
    trained_state: dict | None = None  # the rollout state right after that step's training (emergency checkpoint)
    waiting: str = ""  # at an interruption before step 1: what the start-up waited for (cluster.stop_unplaced)

    def mark_trained(self, step: int, rollout_state: dict) -> None:
        self.trained, self.trained_state = step, rollout_state

    def lost_line(self, checkpoint_dir: Path) -> str:
        """One line: the steps since the last checkpoint that an interruption now loses. A save the interruption
        caught in its thread may have finished all the same: the newest intact checkpoint in `checkpoint_dir` counts."""
        from slime_dsa.checkpoint.training import CheckpointManager, read_orchestrator_state  # noqa: PLC0415

        newest = CheckpointManager(checkpoint_dir).latest()
        self.saved = max(self.saved, read_orchestrator_state(newest)["step"] if newest else 0)
        if self.current <= self.saved:
            return f"no step lost (the last checkpoint is step {self.saved})"
        lost = f"step {self.current}" if self.current == self.saved + 1 else f"steps {self.saved + 1}-{self.current}"
        since = f"the checkpoint of step {self.saved}" if self.saved else "the start (no checkpoint yet)"
        resume = f"; --resume continues from step {self.saved}" if self.saved else ""
        return f"interrupted during step {self.current}: {lost} since {since} in {checkpoint_dir} are lost{resume}"


@dataclass
class Run:
    """Everything a loop needs, built once by `_run`."""

    recipe: RecipeConfig
    algorithm: Algorithm
    run_dir: Path
    model_dir: Path
    client: Any  # rollout.client.EngineClient
    trainers: Any  # trainers.base.TrainerGroup
    manager: Any  # slime_dsa.orchestrator.rollout_manager.RolloutManager
    ckpts: Any  # slime_dsa.checkpoint.training.CheckpointManager
    metrics_log: Any  # slime_dsa.logging.MetricsLogger
    weights: Any  # slime_dsa.orchestrator.weight_sync.WeightTransport
    start_step: int = 0
    on_weights: WeightsHook | None = None
    hook_state: HookState = "every"
    teachers: Any = None  # rollout.teachers.TeacherPool of algorithms whose advantages come from a teacher
    progress: StepProgress = field(default_factory=StepProgress)
    fleet: Any = None  # slime_dsa.orchestrator.engines.EngineFleet (None: no engine actors to watch)
    engine_stats: Any = None  # slime_dsa.orchestrator.perf.EngineStats (None: no perf/engine_* metrics)
    train_flops: Any = None  # slime_dsa.orchestrator.perf.TrainFlops (None: no perf/train_model_tflops, _mfu)
    memory: Any = None  # slime_dsa.orchestrator.colocation.MemoryHandOver, made at the first colocated step
    driver_gc: Any = None  # slime_dsa.gc_watch.GcWatch of this process while the loop runs (perf/driver_gc_*)
    last_hold_s: float = 0.0  # the last step's train call and push: what a prefetched round waits through
    prefetch_held_back: bool = False  # whether a step has skipped its prefetch for last_hold_s (warned once)
    failed_steps: int = 0  # consecutive steps whose every sample failed (the loop stops at FAILED_STEPS_LIMIT)

    def hook_wants_state(self, version: int) -> bool:
        """Whether on_weights gets the full state dict with weight `version`."""
        return self.on_weights is not None and (self.hook_state == "every" or version == self.recipe.trainer.num_steps)


async def after_step(run: Run, step: int, metrics: dict[str, float]) -> None:
    """The tail of every RL step, in either loop: eval when due, log, print, checkpoint when due."""
    recipe = run.recipe
    if run.engine_stats is not None:
        metrics.update(await run.engine_stats.metrics())  # since the last step's: this step's rollouts
    if run.driver_gc is not None:
        counts = run.driver_gc.take()
        metrics.update({"perf/driver_gc_s": counts["gc_s"], "perf/driver_gc_full": counts["gc_full"]})
    evaluated = bool(recipe.logging.eval_every and (step + 1) % recipe.logging.eval_every == 0)
    if evaluated:
        metrics.update(await run.manager.evaluate())
        if run.engine_stats is not None:
            await run.engine_stats.reset()  # the evaluation's generation is not the next step's
    if evaluated or (step + 1) % recipe.logging.log_every == 0 or step + 1 == recipe.trainer.num_steps:
        run.metrics_log.log(metrics, step=step + 1)
        print_step(step + 1, recipe.trainer.num_steps, metrics)
    save_every = recipe.checkpoint.save_every
    if (save_every and (step + 1) % save_every == 0) or step + 1 == recipe.trainer.num_steps:
        # The data position is read here, on the event loop: in the asynchronous loop the producer moves it.
        rollout_state = run.manager.state_dict()
        await checkpoint_run(run, step + 1, rollout_state)
        run.progress.saved = step + 1


async def train_on_samples(run: Run, step: int, samples: list, resume_engines: bool = True,
                           clock: PhaseClock | None = None,
                           while_training: Callable[[], Awaitable[None]] | None = None) -> dict[str, float]:
    """trainer.num_steps_per_rollout optimiser steps of the policy on `samples`, and an algorithm's critic steps;
    returns train/, critic/, advantage/ and perf/ metrics. resume_engines False: colocated engines stay paused after
    training, for a weight push that follows at once and continues them (one continue request less). clock: marks
    the phases batch, to_trainer (colocated on GPUs), train and to_engines (the same) for a profiled step.
    while_training: awaited once the policy's train call is sent to every rank (a prefetch's send: its calls then
    go out while the trainer computes, not while the driver sends the batch), or after training when no policy step
    runs.

    With a critic (slime_dsa/orchestrator/critic.py) the advantages are its per-token GAE, computed before either
    model moves; with teachers (distill.py), the per-token reverse KL to each sample's teacher. The critic trains
    every step, the policy once the algorithm says so (trains_policy: after a critic
    warm-up). A critic placed apart (critic.placement separate) trains while the policy trains.
    """
    import torch  # noqa: PLC0415

    from slime_dsa.orchestrator.batching import build_train_batch, sample_advantages  # noqa: PLC0415

    recipe, trainers, client, algorithm = run.recipe, run.trainers, run.client, run.algorithm
    batch_start = time.perf_counter()
    per_sample = (sample_advantages(samples, algorithm) if algorithm.advantage_level == "sample"
                  else torch.zeros(len(samples)))
    batch = build_train_batch(samples, per_sample, index_replay=recipe.algorithm.index_replay)
    hand_over = {"perf/batch_build_s": time.perf_counter() - batch_start}
    clock = clock or PhaseClock()
    clock.mark("batch")
    # Colocated on GPUs: the engines pause, and hand their KV pool to the trainer while it trains unless they keep it
    # (colocation.py).
    colocated = recipe.cluster.engines_take_turns()
    if colocated:
        start = time.perf_counter()
        if run.memory is None:
            from slime_dsa.orchestrator.colocation import MemoryHandOver  # noqa: PLC0415

            run.memory = MemoryHandOver(client, trainers, recipe.cluster.engine_kv_cache_in_training,
                                        recipe.cluster.trainer_cache_in_rollout)
        await run.memory.to_trainer()
        hand_over["perf/rollout_sleep_s"] = time.perf_counter() - start
        clock.mark("to_trainer")
    sent = asyncio.Event()
    after_send = asyncio.create_task(_when_set(sent, while_training)) if while_training is not None else None
    trains_policy = algorithm.trains_policy(step)
    train_start = time.perf_counter()
    try:
        metrics = await _train_roles(run, step, batch, samples, trains_policy, _threadsafe_setter(sent))
        train_time = time.perf_counter() - train_start
        if after_send is not None:
            sent.set()  # no policy call this step (a critic's warm-up): now
            await after_send
    finally:
        if after_send is not None and not after_send.done():
            after_send.cancel()
    clock.mark("train")
    if colocated:
        start = time.perf_counter()
        # A push that follows at once and fills a buffer (cuda_ipc) does so in the trainers' release call.
        release = None if resume_engines else getattr(run.weights, "release_and_prepare", None)
        await run.memory.to_engines(resume=resume_engines, release=release)
        hand_over["perf/rollout_wake_s"] = time.perf_counter() - start
        clock.mark("to_engines")
    metrics.update(hand_over)
    metrics.update({"perf/train_time_s": train_time, "perf/train_tok_s": batch.num_tokens / max(train_time, 1e-9),
                    "train/num_tokens": batch.num_tokens})
    if run.train_flops is not None and trains_policy:  # the policy's FLOPs (a critic's time counts, its FLOPs not)
        metrics.update(run.train_flops.metrics(batch.num_tokens, train_time,
                                               recompute_forward=algorithm.old_logprobs == "recompute"))
    return metrics


# The trainers' weight-sync check of the first optimiser step's forward (TrainerRank.train_step, measure_sync).
SYNC_KEYS = ("sync_logprob_abs_diff", "sync_logprob_abs_diff_max", "sync_logprob_exact")


async def _train_roles(run: Run, step: int, batch, samples: list, trains_policy: bool,
                       on_sent: Callable[[], None]) -> dict[str, float]:
    """The step's train calls: the critic's estimates and steps (with one), the policy's when it trains; their
    metrics. on_sent: called once the policy's call is sent to its ranks."""
    from slime_dsa.orchestrator.critic import critic_estimates, train_critic  # noqa: PLC0415

    recipe, trainers, algorithm = run.recipe, run.trainers, run.algorithm
    with_critic = "critic" in algorithm.roles
    # Metrics that cost real compute (the indexer's dense recall) only on the steps after_step logs.
    logged = (step + 1) % recipe.logging.log_every == 0 or step + 1 == recipe.trainer.num_steps
    metrics: dict[str, float] = await critic_estimates(trainers, algorithm, batch, samples) if with_critic else {}
    if algorithm.advantage_source == "teacher":
        from slime_dsa.orchestrator.distill import teacher_estimates  # noqa: PLC0415

        metrics.update(teacher_estimates(algorithm, run.teachers, batch, samples))
    mini_batches = recipe.trainer.num_steps_per_rollout
    # Calls made only when run: a later one is never created when an earlier one raises (Ctrl-C during the critic's)
    jobs = [lambda: train_critic(trainers, algorithm, batch, mini_batches, logged)] if with_critic else []
    if trains_policy:
        jobs.append(lambda: _train_policy(run, step, batch, logged, on_sent))
    if with_critic and recipe.critic.placement == "separate":
        results = await asyncio.gather(*(job() for job in jobs))  # different ranks: critic and policy at once
    else:
        results = [await job() for job in jobs]  # the same ranks: one call at a time (their collectives must pair)
    for result in results:
        metrics.update(result)
    metrics["train/policy_steps"] = min(mini_batches, len(samples)) if trains_policy else 0
    return metrics


async def _when_set(event: asyncio.Event, action: Callable[[], Awaitable[None]]) -> None:
    await event.wait()
    await action()


def _threadsafe_setter(event: asyncio.Event) -> Callable[[], None]:
    """A callable that sets `event` from any thread (a train call's, which runs off the event loop)."""
    loop = asyncio.get_running_loop()
    return lambda: loop.call_soon_threadsafe(event.set)


async def _train_policy(run: Run, step: int, batch, logged: bool,
                        on_sent: Callable[[], None] | None = None) -> dict[str, float]:
    """The policy's optimiser steps of one RL step; train/ metrics.

    The algorithm's π_old mode says how the step gets π_old: recompute = a trainer forward (and
    train_rollout_logprob_abs_diff from it); rollout = bypass, π_old := π_roll (train_rollout_logprob_abs_diff from
    the first optimiser step's forward); none = no π_old at all (DIS, whose ratio is π_θ / π_roll), and
    train_rollout_logprob_abs_diff is the loss's mean |log π_θ − log π_roll| (staleness included).
    """
    from slime_dsa.orchestrator.batching import logprob_agreement  # noqa: PLC0415

    recipe = run.recipe
    old_logprobs: OldLogprobs = run.algorithm.old_logprobs
    metrics: dict[str, float] = {}
    if old_logprobs == "rollout":
        batch.old_logprobs = batch.rollout_logprobs.clone()
    recompute = old_logprobs == "recompute"
    # One call per rank: π_old (recompute) and every optimiser step of this RL step.
    old, train_metrics = await asyncio.to_thread(run.trainers.train, batch, recipe.trainer.num_steps_per_rollout,
                                                 recompute, logged, on_sent=on_sent)
    # The weight-sync check: π_old's forward when recomputed, else the first optimiser step's (same weights).
    agreement = {k: train_metrics.pop(k) for k in SYNC_KEYS if k in train_metrics}
    metrics.update({f"perf/{k}": train_metrics.pop(k) for k in list(train_metrics)
                    if k.startswith(CALL_METRIC_PREFIXES)})
    if recompute:
        batch.old_logprobs = old
        agreement = logprob_agreement(batch)
    sync_gap = agreement.get("sync_logprob_abs_diff")
    if sync_gap is not None and old_logprobs != "none":
        metrics["train/train_rollout_logprob_abs_diff"] = sync_gap
        for key, name in (("sync_logprob_abs_diff_max", "train_rollout_logprob_abs_diff_max"),
                          ("sync_logprob_exact", "train_rollout_logprob_exact_frac")):
            if key in agreement:
                metrics[f"train/{name}"] = agreement[key]
        if sync_gap > recipe.trainer.logprob_diff_warn_threshold:
            logger.warning("step %d: train_rollout_logprob_abs_diff %.4g exceeds %.4g: trainer and engine weights "
                           "or numerics disagree", step + 1, sync_gap, recipe.trainer.logprob_diff_warn_threshold)
    keep_loss_diff = old_logprobs == "none"
    metrics.update({f"train/{k}": v for k, v in train_metrics.items()
                    if keep_loss_diff or k != "train_rollout_logprob_abs_diff"})
    if "train/dis_frac_below" in metrics and "train/dis_frac_above" in metrics:
        metrics["train/dis_frac_outside"] = metrics["train/dis_frac_below"] + metrics["train/dis_frac_above"]
    return metrics


async def sync_weights(weights, version: int, pause_mode: str = "abort",
                       on_weights: WeightsHook | None = None, want_state: bool | None = None,
                       fleet: Any = None) -> float:
    """The trainers' weights to every engine as `version` (a WeightTransport); returns the seconds it took.
    on_weights gets the state dict when `want_state` (default: whenever there is a hook), else None. fleet: the run's
    EngineFleet; when every engine is gone while it starts replacements, the push waits for them and goes to them."""
    from rollout.client import NoEnginesLeftError  # noqa: PLC0415

    start = time.perf_counter()
    want = on_weights is not None and want_state is not False
    try:
        state = await weights.push(version, pause_mode=pause_mode, want_state=want)
    except NoEnginesLeftError:
        if fleet is None or not await fleet.wait_for_restarts():
            raise
        state = await weights.push(version, pause_mode=pause_mode, want_state=want)
    elapsed = time.perf_counter() - start
    if on_weights is not None:
        on_weights(version, state)
    return elapsed


async def ensure_engines(run: Run, version: int) -> None:
    """Before generating: when every engine is gone, wait for the replacements being started and give them the
    weights of `version`; rollout.client.NoEnginesLeftError when none comes."""
    from rollout.client import NoEnginesLeftError  # noqa: PLC0415

    if run.client.engines:
        return
    if run.fleet is not None and await run.fleet.wait_for_restarts():
        await sync_weights(run.weights, version)  # the staged replacements join with the current weights
        return
    raise NoEnginesLeftError(f"every engine was lost ({len(run.client.lost)} in all; the last: "
                             f"{run.client.lost[-1][0] if run.client.lost else 'none'})")


async def probe_engines(run: Run) -> None:
    """GET /health on every engine, dropping those that cannot be reached (a step that got no sample at all).
    NoEnginesLeftError when none is left and no replacement is being started (the next step waits for those)."""
    from rollout.client import NoEnginesLeftError  # noqa: PLC0415

    try:
        await run.client.broadcast("/health", method="GET", check=False, drop_unreachable=True, timeout_s=30)
    except NoEnginesLeftError:
        if run.fleet is None or not run.fleet.restarting:
            raise


async def emergency_checkpoint(run: Run) -> Path | None:
    """A checkpoint of the last trained step when it has none yet (the run cannot go on); the newest otherwise."""
    progress = run.progress
    if progress.trained > progress.saved and progress.trained_state is not None:
        await checkpoint_run(run, progress.trained, progress.trained_state)
        progress.saved = progress.trained
    return run.ckpts.path_for(progress.saved) if progress.saved else None


async def checkpoint_run(run: Run, step: int, rollout_state: dict) -> None:
    """Checkpoint `step`, metrics.jsonl fsynced first: the records of the steps a checkpoint covers reach the disk
    before it does (a resume from it keeps them and logs only the steps after it)."""
    run.metrics_log.sync()
    await asyncio.to_thread(save_checkpoint, run.ckpts, step, run.trainers, rollout_state, run.model_dir)


def save_checkpoint(ckpts, step: int, trainers, rollout_state: dict, model_dir: Path) -> None:
    """Checkpoint `step`; a full disk (or any OSError, raised here or in a trainer rank) is one UserError naming the
    checkpoint and the newest intact one (the temporary directory is already removed)."""
    from slime_dsa.config.errors import UserError  # noqa: PLC0415

    def write(tmp: Path) -> None:
        trainers.save_checkpoint(str(tmp))
        for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "special_tokens_map.json", "chat_template.jinja"):  # generation_config.json: its eos ids stop
            if (model_dir / name).exists():
                shutil.copy2(model_dir / name, tmp / name)

    try:
        ckpts.save(step, write, {"rollout": rollout_state})
    except Exception as e:
        problem = write_problem(getattr(e, "cause", None) or e)  # a Ray task error carries the rank's error
        if problem is None:
            raise
        newest = ckpts.latest()
        raise UserError(f"checkpoint of step {step} not written to {ckpts.directory}: {problem}; "
                        f"the newest intact checkpoint is {newest or 'none'}") from None


def print_step(step: int, total: int, metrics: dict[str, float]) -> None:
    """One console line per step: the numbers a person watches."""
    from rich.console import Console  # noqa: PLC0415

    keys = [("rollout/reward_mean", "reward"), ("eval/pass@1", "eval pass@1"), ("train/loss", "loss"),
            ("train/train_rollout_logprob_abs_diff", "|Δlogp|"), ("critic/value_loss", "value loss"),
            ("critic/explained_variance", "EV"), ("advantage/teacher_reverse_kl", "reverse KL"),
            ("perf/step_time_s", "step s")]
    parts = [f"{label} {metrics[k]:.4g}" for k, label in keys if k in metrics and not _nan(metrics[k])]
    if "perf/trainer_gpu_busy_share" in metrics:  # on a GPU with nvidia-ml-py
        parts.append(f"GPU busy {metrics['perf/trainer_gpu_busy_share']:.0%}")
    # soft_wrap: one line per step also when stderr is a file or a narrow terminal
    Console(stderr=True, soft_wrap=True).print(f"[bold]step {step}/{total}[/bold]  " + "  ".join(parts))


def _nan(x: float) -> bool:
    return isinstance(x, float) and math.isnan(x)
