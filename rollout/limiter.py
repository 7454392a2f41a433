"""A counting limit on samples in flight, where one request may carry several samples (a group's batch)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class SampleLimiter:
    """At most `limit` samples in flight. asyncio.Semaphore takes one permit at a time: a group taking its n
    permits one by one could deadlock against another group holding the rest, so n are taken at once here."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the limit must be >= 1, got {limit}")
        self.limit = limit
        self.in_flight = 0
        self._changed = asyncio.Condition()

    @asynccontextmanager
    async def hold(self, count: int) -> AsyncIterator[None]:
        """Hold `count` places while the block runs (a count above the limit waits for all of them)."""
        count = min(count, self.limit)
        async with self._changed:
            await self._changed.wait_for(lambda: self.in_flight + count <= self.limit)
            self.in_flight += count
        try:
            yield
        finally:
            async with self._changed:
                self.in_flight -= count
                self._changed.notify_all()
