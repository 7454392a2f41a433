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

    def drain(self) -> list[list[Sample]]:
        """Remove and return everything buffered now."""
        taken, self._groups = self._groups, []
        return taken
