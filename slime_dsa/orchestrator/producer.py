"""The asynchronous loop's rollout: a producer that keeps starting groups while the trainer trains.

A group starts whenever the StalenessGate admits one and goes into the SampleBuffer when done. The producer
tracks the groups it started that the trainer has not taken (in flight or buffered): a checkpoint records them,
and a run resumed from it regenerates them first (same prompts, sample indices and seeds), so across a save and
resume no prompt is lost or used twice.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from rollout.groups import GroupRollout, SampleNumbering
from slime_dsa.data.sample import Sample, SampleStatus
from slime_dsa.orchestrator.buffer import SampleBuffer, StalenessGate

if TYPE_CHECKING:
    from slime_dsa.config.schema import RolloutSection
    from slime_dsa.data.prompts import Prompt, TaskMixture

logger = logging.getLogger(__name__)

MAX_REQUEUES = 3  # an aborted sample is regenerated at most this many times (pause mode abort)


class GroupProducer:
    """Produces groups from `mixture`, numbered by `numbering`, into `buffer`."""

    def __init__(self, groups: GroupRollout, mixture: TaskMixture, numbering: SampleNumbering,
                 rollout: RolloutSection, buffer: SampleBuffer | None = None) -> None:
        self.groups, self.mixture, self.numbering, self.cfg = groups, mixture, numbering, rollout
        self.buffer = buffer or SampleBuffer()
        self.produced_indices: list[int] = []  # every sample index `produce` started, in order
        self.in_flight: dict[int, list[int]] = {}  # group_id -> sample indices: started, not buffered yet
        self._draws: dict[int, tuple[str, int]] = {}  # group_id -> its prompt's mixture draw (task, number)
        self._replay: list[dict[str, Any]] = []  # groups pending in the checkpoint resumed from, not restarted yet

    # -- resume state ---------------------------------------------------------------------------

    def pending_groups(self) -> list[dict[str, Any]]:
        """The groups started and not taken by the trainer, and those of a resumed checkpoint not restarted yet: what
        a resumed run regenerates. Call it on the event loop."""
        pending = self._pending_indices()
        started = [{"group_id": g, "first_index": indices[0], "num_samples": len(indices), "task": self._draws[g][0],
                    "draw": self._draws[g][1]} for g, indices in sorted(pending.items()) if g in self._draws]
        return self._replay + started

    def load_pending_groups(self, groups: list[dict[str, Any]]) -> None:
        """Regenerate `groups` (from pending_groups) before drawing new prompts."""
        self._replay = list(groups)

    @property
    def num_pending_replays(self) -> int:
        """Groups of the checkpoint resumed from that `produce` has yet to restart."""
        return len(self._replay)

    def _pending_indices(self) -> dict[int, list[int]]:
        """group_id -> sample indices of the groups started and not taken; forgets the draws of the others."""
        buffered = {g[0].group_id: sorted(s.index for s in g) for g in self.buffer.peek() if g}
        pending = {**self.in_flight, **buffered}
        self._draws = {g: d for g, d in self._draws.items() if g in pending}
        return pending

    # -- production -----------------------------------------------------------------------------

    async def produce(self, gate: StalenessGate, requeue_aborted: bool) -> None:
        """Start a group whenever `gate` admits one and put it into the buffer when done; runs until cancelled.

        requeue_aborted: a sample the engine aborted (weights pushed with pause mode abort) is regenerated from
        scratch under the new weights, up to MAX_REQUEUES times; otherwise it stays aborted (not trained on).
        """
        running: set[asyncio.Task] = set()
        try:
            while True:
                await gate.acquire()
                prompt, samples, draw = self._next_group()
                self.produced_indices.extend(s.index for s in samples)
                self.in_flight[samples[0].group_id] = [s.index for s in samples]
                self._draws[samples[0].group_id] = draw
                if len(self._draws) > 2 * len(self.in_flight) + 2 * len(self.buffer) + 64:
                    self._pending_indices()  # forget the draws of groups the trainer took
                task = asyncio.create_task(self._produce_group(prompt, samples, requeue_aborted))
                running.add(task)
                task.add_done_callback(running.discard)
        finally:
            for task in list(running):
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    def _next_group(self) -> tuple[Prompt, list[Sample], tuple[str, int]]:
        """(prompt, its numbered samples, its mixture draw): first the groups a resumed checkpoint had pending, as
        they were, then fresh prompts."""
        if self._replay:
            group = self._replay.pop(0)
            draw = (group["task"], group["draw"])
            prompt = self.mixture.replay(*draw)
            samples = [prompt.to_sample(index=group["first_index"] + k, group_id=group["group_id"])
                       for k in range(group["num_samples"])]
            return prompt, samples, draw
        prompt = next(self.mixture)
        return prompt, self.numbering.new_group(prompt, self.cfg.n_samples_per_prompt), self.mixture.last_draw

    async def _produce_group(self, prompt: Prompt, samples: list[Sample], requeue_aborted: bool) -> None:
        async def requeued(done: Sample) -> Sample:
            """An aborted sample regenerated from scratch, up to MAX_REQUEUES times (when asked)."""
            for attempt in range(MAX_REQUEUES):
                if done.status != SampleStatus.ABORTED or not requeue_aborted:
                    return done
                sample = prompt.to_sample(index=done.index, group_id=done.group_id)
                sample.metadata["requeued"] = attempt + 1
                (done,) = await self.groups.generate_group([sample])
            return done

        try:
            group = await self.groups.generate_group(samples)
            group = list(await asyncio.gather(*(requeued(s) for s in group)))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug here costs this group, never the run (the trainer waits on it)
            logger.exception("group %s failed", samples[0].group_id)
            for s in samples:
                s.status = SampleStatus.FAILED
                s.metadata["error"] = f"{type(e).__name__}: {e}"
            group = samples
        await self.buffer.put(group)
        del self.in_flight[samples[0].group_id]  # no await since the put: a group is never in both places
