"""The asynchronous RL loop (GLM-5's asynchronous stage; docs/algorithms.md §4): rollout never waits for training.

A producer task (`RolloutManager.produce`) keeps generating groups into the SampleBuffer while the trainer
consumes them, one step of `prompts_per_step` groups at a time:
1. take groups from the buffer in the order they finished; drop the samples whose oldest generated token is more
   than `max_staleness` versions behind the trainer (counted), discard groups left untrainable (their slot is
   regenerated; a step that drops MAX_DROPPED_STEPS steps' groups beyond those in flight stops the run);
2. the algorithm's training step (async_reinforce: the DIS loss, r = π_θ / π_roll per token with no π_old
   recomputed, on group-centred advantages; sao: the same loss on a critic's per-token GAE, groups of one, and the
   critic's own updates, step.train_on_samples), while the producer keeps generating;
3. push the new weights in flight: pause (retract | in_place: requests continue under the new weights, a
   partial rollout; abort: they are regenerated), update, resume. Every token records its own version;
4. the StalenessGate lets the producer one step further, and the shared per-step tail (eval, log, checkpoint)
   runs while it generates (with max_staleness 0 the gate opens after the tail, as in the synchronous loop).

`max_staleness: 0` is the synchronous loop: the gate admits one step's groups under the current weights and
nothing is in flight at a weight push, so the same seed gives the same samples, batches and metrics (up to
the ~1e-7 log-prob noise of decode-batch composition; tests/test_async.py checks it). Each sample's fate
(trained, stale, discarded, still buffered or in flight at the end) goes to `rollout_ledger.jsonl`.
Metrics beside the synchronous loop's: async/ (staleness mean and max, version spread of the batch's tokens,
share of partial rollouts, stale samples dropped); train/dis_frac_below|above come from the loss;
perf/rollout_time_s is the time between two batches and perf/rollout_wait_s the part the trainer waited.
Resuming is exact in what it trains: the checkpoint holds the groups started and not yet trained (in flight or
buffered at save), and the resumed producer regenerates them (same prompts, sample indices and seeds, under the
checkpoint's weights) before it draws new prompts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from slime_dsa.config.errors import UserError
from slime_dsa.data.sample import NO_WEIGHT_VERSION, Sample
from slime_dsa.durable import write_atomic
from slime_dsa.interrupts import raise_if_terminated
from slime_dsa.orchestrator.buffer import SampleBuffer, StalenessGate
from slime_dsa.orchestrator.collection import screen_group
from slime_dsa.orchestrator.step import Run, after_step, ensure_engines, sync_weights, train_on_samples

if TYPE_CHECKING:
    from slime_dsa.config.schema import RolloutSection

logger = logging.getLogger(__name__)

PAUSE_MODES = {"retract": "retract", "in_place": "in_place", "off": "abort"}  # algorithm.partial_rollout -> engine
# Steps' worth of groups a step may drop (failed, or uniform under dynamic sampling) beyond those in flight before it
# gives up: the synchronous loop's default budget, max_sampling_tries 4 rounds of max_oversample_factor 4 x the step.
MAX_DROPPED_STEPS = 16


def generated_versions(sample: Sample) -> list[int]:
    """Weight versions of the tokens the policy generated (tool/environment tokens have none)."""
    return [v for v, m in zip(sample.weight_versions, sample.loss_mask) if m and v != NO_WEIGHT_VERSION]


def sample_staleness(sample: Sample, version: int) -> int:
    """Trainer version minus the version of the sample's oldest generated token (0 when it generated none)."""
    versions = generated_versions(sample)
    return version - min(versions) if versions else 0


def versions_consistent(sample: Sample, version: int) -> bool:
    """Token versions never decrease along the response and none is newer than the trainer's `version`."""
    versions = generated_versions(sample)
    return all(0 <= a <= b for a, b in zip(versions, versions[1:])) and all(0 <= v <= version for v in versions)


class Ledger:
    """`rollout_ledger.jsonl`: one line per step with the sample indices trained on, dropped as stale and
    discarded; a last line with the producer's indices and those still buffered or in flight."""

    def __init__(self, path: Path, resume_step: int = 0) -> None:
        """resume_step > 0: a run resumed from that step's checkpoint appends, after dropping the step records an
        interrupted session wrote past it (those steps run again); 0: a new ledger."""
        if resume_step > 0 and path.exists():
            _drop_steps_after(path, resume_step)
        self._file = path.open("a" if resume_step > 0 else "w")

    def step(self, step: int, version: int, fates: dict[str, list[int]]) -> None:
        self._file.write(json.dumps({"step": step, "trainer_version": version, **fates}) + "\n")
        self._file.flush()

    def close(self, produced: list[int], buffered: list[int], in_flight: list[int]) -> None:
        self._file.write(json.dumps({"end": True, "produced": produced, "buffered": buffered,
                                     "in_flight": in_flight}) + "\n")
        self._file.close()


def _drop_steps_after(path: Path, step: int) -> None:
    """Rewrite the ledger at `path` without the step records past `step` (the session markers stay) and without a
    line a killed session left half written."""
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.endswith("\n") and _step_of(line) <= step]
    if len(kept) == len(lines):
        return
    write_atomic(path, "".join(kept))  # a failed or interrupted rewrite leaves the old ledger whole
    logger.info("%s: dropped %d step records past the checkpoint of step %d (those steps run again)", path.name,
                len(lines) - len(kept), step)


def _step_of(line: str) -> float:
    """A ledger line's step (0 for a session's end marker; infinite for a line that is not JSON)."""
    try:
        return json.loads(line).get("step", 0)
    except ValueError:
        return float("inf")


async def run_async_loop(run: Run) -> None:
    """Train run.recipe to trainer.num_steps with rollout and training overlapped."""
    recipe, manager = run.recipe, run.manager
    alg = recipe.algorithm
    gate = StalenessGate(recipe.rollout.prompts_per_step, alg.max_staleness, version=run.start_step)
    pause_mode = PAUSE_MODES[alg.partial_rollout]
    producer = asyncio.create_task(manager.produce(gate, requeue_aborted=pause_mode == "abort"), name="rollout-producer")
    ledger = Ledger(run.run_dir / "rollout_ledger.jsonl", resume_step=run.start_step)
    totals: Counter[str] = Counter()
    last_batch = time.perf_counter()
    try:
        for step in range(run.start_step, recipe.trainer.num_steps):
            raise_if_terminated()
            run.progress.current = step + 1
            step_start = time.perf_counter()
            kept, metrics, fates = await _collect(run, gate, producer, version=step, totals=totals,
                                                  since=last_batch)
            last_batch = time.perf_counter()
            ledger.step(step + 1, step, fates)
            samples = [s for group in kept for s in group]
            metrics.update(await train_on_samples(run, step, samples))
            run.progress.mark_trained(step + 1, manager.state_dict())
            metrics["perf/sync_time_s"] = await sync_weights(run.weights, version=step + 1, pause_mode=pause_mode,
                                                              on_weights=run.on_weights,
                                                              want_state=run.hook_wants_state(step + 1),
                                                              fleet=run.fleet)
            metrics["perf/step_time_s"] = time.perf_counter() - step_start
            # An on_weights hook's read-back is in the sync time; said apart, as in the synchronous loop.
            metrics["perf/weights_readback_s"] = getattr(run.weights, "last_read_s", 0.0)
            last = step + 1 == recipe.trainer.num_steps
            if alg.max_staleness > 0 and not last:
                await gate.advance(step + 1)  # the new weights are on the engines: rollout goes on during the tail
            await after_step(run, step, metrics)
            if alg.max_staleness == 0 and not last:
                await gate.advance(step + 1)  # the synchronous loop's order: eval before the next step's rollout
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        buffered = [s.index for group in manager.buffer.drain() for s in group]
        in_flight = [i for indices in manager.in_flight.values() for i in indices]
        ledger.close(list(manager.produced_indices), buffered, in_flight)


async def _collect(run: Run, gate: StalenessGate, producer: asyncio.Task, version: int, totals: Counter,
                   since: float) -> tuple[list[list[Sample]], dict[str, float], dict[str, list[int]]]:
    """One step's groups from the buffer (stale samples dropped), their metrics, and every taken sample's fate."""
    cfg, manager = run.recipe.rollout, run.manager
    max_staleness = run.recipe.algorithm.max_staleness
    wait_start = time.perf_counter()
    kept: list[list[Sample]] = []
    taken: list[Sample] = []
    counters: Counter[str] = Counter()
    fates: dict[str, list[int]] = {"trained": [], "stale": [], "discarded": []}
    dropped, most_dropped = 0, (MAX_DROPPED_STEPS + max_staleness + 1) * cfg.prompts_per_step
    while len(kept) < cfg.prompts_per_step:
        await ensure_engines(run, version)  # none left: wait for replacements (or stop the run)
        group = await _next_group(manager.buffer, producer)
        taken.extend(group)
        fresh = []
        for s in group:
            if sample_staleness(s, version) > max_staleness:
                fates["stale"].append(s.index)
            else:
                fresh.append(s)
        usable = screen_group(fresh, cfg.dynamic_sampling, counters, manager.min_group_size)
        if usable is None:
            fates["discarded"].extend(s.index for s in fresh)
            dropped += 1
            if dropped > most_dropped:  # each is regenerated: the step would wait forever
                raise UserError(_dropped_line(version + 1, dropped, len(kept), cfg, counters, manager.min_group_size))
            await gate.replace(1)
            continue
        kept.append(usable)
        used = {s.index for s in usable}
        fates["trained"].extend(sorted(used))
        fates["discarded"].extend(s.index for s in fresh if s.index not in used)
    wait = time.perf_counter() - wait_start
    kept.sort(key=lambda g: g[0].group_id)  # the synchronous loop's order: by prompt
    metrics = manager.rollout_metrics(taken, kept, counters, time.perf_counter() - since)
    manager.reset_reward_stats()
    metrics.update(_staleness_metrics([s for g in kept for s in g], version))
    totals["stale_samples"] += len(fates["stale"])
    metrics.update({
        "async/stale_samples": len(fates["stale"]), "async/stale_samples_total": totals["stale_samples"],
        "async/buffered_groups": len(manager.buffer), "async/in_flight_groups": len(manager.in_flight),
        "perf/rollout_wait_s": wait,
    })
    if fates["stale"]:
        logger.info("step %d: dropped %d stale samples (older than %d versions)", version + 1, len(fates["stale"]),
                    max_staleness)
    return kept, metrics, fates


def _dropped_line(step: int, dropped: int, kept: int, cfg: RolloutSection, counters: Counter,
                  min_group_size: int) -> str:
    """Why a step stopped: how many groups it dropped, and for what."""
    uniform = (f"{counters['zero_std_groups']} whose rewards all agree, dropped by rollout.dynamic_sampling; "
               if cfg.dynamic_sampling else "")
    return (f"step {step}: {dropped} groups could not be trained on and {kept} of {cfg.prompts_per_step} could "
            f"({uniform}{counters['dropped_groups']} with fewer than {min_group_size} usable samples, "
            f"{counters['failed_samples']} samples failed): the asynchronous loop regenerates each, so the step "
            "would never fill; check the reward function (rollout/reward_failures, train.log) and the engines")


def _staleness_metrics(samples: list[Sample], version: int) -> dict[str, float]:
    """Mean and max staleness, the version spread of the batch's tokens, the share of partial rollouts."""
    staleness = [sample_staleness(s, version) for s in samples]
    versions = [v for s in samples for v in generated_versions(s)]
    inconsistent = sum(not versions_consistent(s, version) for s in samples)
    if inconsistent:
        logger.warning("step %d: %d samples carry inconsistent weight_versions", version + 1, inconsistent)
    n = max(len(samples), 1)
    return {
        "async/trainer_version": version,
        "async/staleness_mean": sum(staleness) / n,
        "async/staleness_max": max(staleness, default=0),
        "async/version_spread": (max(versions) - min(versions)) if versions else 0,
        "async/partial_rollout_frac": sum(len(set(generated_versions(s))) > 1 for s in samples) / n,
        "async/requeued_samples": sum(bool(s.metadata.get("requeued")) for s in samples),
        "async/inconsistent_version_samples": inconsistent,
    }


async def _next_group(buffer: SampleBuffer, producer: asyncio.Task) -> list[Sample]:
    """The oldest finished group; raises the producer's error if it stopped instead."""
    get = asyncio.ensure_future(buffer.get(1))
    done, _ = await asyncio.wait({get, producer}, return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()[0]
    get.cancel()
    await asyncio.gather(get, return_exceptions=True)
    producer.result()  # raises what stopped it
    raise RuntimeError("the rollout producer stopped")
