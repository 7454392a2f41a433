"""The sample buffer between rollout (producer) and training (consumer).

The synchronous loop fills it and drains it each step; the asynchronous loop keeps a producer running while the
trainer consumes, which is why the two meet here and not in a function call.
"""

from __future__ import annotations

import asyncio

from slime_dsa.data.sample import Sample


class SampleBuffer:
    """A FIFO of finished groups (lists of samples of one prompt)."""

    def __init__(self) -> None:
        self._groups: list[list[Sample]] = []
        self._changed = asyncio.Condition()

    def __len__(self) -> int:
        return len(self._groups)

    async def put(self, group: list[Sample]) -> None:
        async with self._changed:
            self._groups.append(group)
            self._changed.notify_all()

    async def get(self, num_groups: int) -> list[list[Sample]]:
        """Wait for and remove the oldest `num_groups` groups."""
        async with self._changed:
            await self._changed.wait_for(lambda: len(self._groups) >= num_groups)
            taken, self._groups = self._groups[:num_groups], self._groups[num_groups:]
            return taken

    def peek(self) -> list[list[Sample]]:
        """The buffered groups, oldest first, left in place."""
        return list(self._groups)

    def drain(self) -> list[list[Sample]]:
        """Remove and return everything buffered now."""
        taken, self._groups = self._groups, []
        return taken


class StalenessGate:
    """When the asynchronous loop's producer may start its next group (AReaL's bound on staleness).

    Group k (counted from 0 over the run) may start once k < (version + max_staleness + 1) · groups_per_step +
    replaced, where `version` is the trainer's. The producer thus never runs more than max_staleness steps ahead
    of the trainer; with max_staleness 0 it generates exactly one step's groups under the current weights and
    waits, which is the synchronous loop. `replaced` gives back the slots of groups the trainer discarded
    (stale, failed or uniform under dynamic sampling), so a discarded group is regenerated, never waited for.
    """

    def __init__(self, groups_per_step: int, max_staleness: int, version: int = 0) -> None:
        if groups_per_step < 1 or max_staleness < 0:
            raise ValueError(f"need groups_per_step >= 1 and max_staleness >= 0, got {groups_per_step}, {max_staleness}")
        self.groups_per_step, self.max_staleness = groups_per_step, max_staleness
        self.version = version
        self.started = version * groups_per_step  # a resumed run starts at its step's first group
        self.replaced = 0
        self._changed = asyncio.Condition()

    @property
    def limit(self) -> int:
        return (self.version + self.max_staleness + 1) * self.groups_per_step + self.replaced

    async def acquire(self) -> None:
        """Wait until one more group may start, and count it as started."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.started < self.limit)
            self.started += 1

    async def advance(self, version: int) -> None:
        """The trainer reached `version` (its weights are on the engines)."""
        async with self._changed:
            self.version = version
            self._changed.notify_all()

    async def replace(self, num_groups: int = 1) -> None:
        """The trainer discarded `num_groups` groups: let as many new ones start."""
        async with self._changed:
            self.replaced += num_groups
            self._changed.notify_all()
