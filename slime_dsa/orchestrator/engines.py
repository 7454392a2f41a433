"""The run's engines while it trains: a lost engine is dropped and, if the recipe allows, replaced.

An engine is lost when its Ray actor's process dies (noticed at once: each actor has a wait_stopped call pending,
which Ray fails when the process goes) or when a weight update cannot reach it (rollout.client drops it; external
engines are noticed only so). The run goes on with the others; its samples in flight there are retried on the
others or counted as failed. With rollout.restart_dead_engines, a new actor is started in the background and
staged: it joins at the next weight update, with that update's weights (when none is left meanwhile, the push and
the next step wait for it). An external server (rollout.engine external: no actor to replace) that is lost is
probed on /health with backoff instead, and staged the same way when it answers: it serves nothing until the next
weight update has given it the run's weights. When none is left and none is being started or probed (or none has
come within wait_for_restarts' timeout), the loops stop with rollout.client.NoEnginesLeftError (the driver writes an
emergency checkpoint).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

RESTARTS_PER_ENGINE = 2  # a run replaces at most this many engines per configured engine (no crash loop)
READMIT_FIRST_S, READMIT_MAX_S = 1.0, 60.0  # waits between a lost external server's /health probes: doubled to the max


class EngineFleet:
    """Watches `actors` ({url: Ray actor handle}) of `client`; `start_one()` (blocking) starts a replacement and returns
    (url, actor), or is None when lost engines are not replaced. `readmit`: URLs of servers the run did not start,
    probed and staged again when lost."""

    def __init__(self, client: Any, actors: dict[str, Any], start_one: Callable[[], tuple[str, Any]] | None,
                 readmit: Sequence[str] = ()) -> None:
        from rollout.client import normalize_url  # noqa: PLC0415

        self.client = client
        self.actors = {normalize_url(url): actor for url, actor in actors.items()}
        self.start_one = start_one
        self.readmit = {normalize_url(url) for url in readmit}
        self.max_restarts = self.restarts_left = RESTARTS_PER_ENGINE * max(1, len(actors))
        self._watchers: dict[str, asyncio.Task] = {}
        self._restarts: set[asyncio.Task] = set()
        self._probes: dict[str, asyncio.Task] = {}  # lost external servers' /health probes
        self._closed = False
        client.on_engine_lost(self._on_lost)

    def start(self) -> None:
        """Begin watching every actor (call on the running event loop)."""
        for url, actor in self.actors.items():
            self._watch(url, actor)

    @property
    def restarting(self) -> int:
        """Replacements being started, and lost external servers being probed."""
        return len(self._restarts) + len(self._probes)

    def _watch(self, url: str, actor: Any) -> None:
        self._watchers[url] = asyncio.create_task(self._wait_for_death(url, actor), name=f"watch {url}")

    async def _wait_for_death(self, url: str, actor: Any) -> None:
        try:
            await actor.wait_stopped.remote()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - RayActorError and its kin: the process is gone
            if not self._closed:
                reason = f"its process died ({type(e).__name__})"
                if not self.client.drop_engine(url, reason):
                    self.client.unstage(url, reason)

    def _on_lost(self, url: str, reason: str) -> None:
        """The client dropped `url`: end its actor, and start a replacement when allowed."""
        watcher = self._watchers.pop(url, None)
        if watcher is not None and watcher is not asyncio.current_task():
            watcher.cancel()
        actor = self.actors.pop(url, None)
        if actor is not None:
            _kill(actor)  # it may be hung rather than dead
        if actor is None and url in self.readmit and not self._closed:
            self._probe_back(url)
            return
        if self._closed or self.start_one is None or actor is None:
            return
        if self.restarts_left <= 0:
            logger.warning("engine %s is not replaced: the run has used its %d replacements", url, self.max_restarts)
            return
        self.restarts_left -= 1
        task = asyncio.get_running_loop().create_task(self._restart(url), name=f"restart {url}")
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, lost_url: str) -> None:
        try:
            url, actor = await asyncio.to_thread(self.start_one)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the run goes on with fewer engines
            # One line: Ray's own (an actor whose node died before it ran) spans four
            logger.warning("could not replace engine %s: %s: %s", lost_url, type(e).__name__, " ".join(str(e).split()))
            return
        if self._closed:
            _kill(actor)
            return
        self.actors[url] = actor
        self._watch(url, actor)
        self.client.stage_engine(url)
        logger.info("engine %s replaced by %s; it joins at the next weight update", lost_url, url)

    def _probe_back(self, url: str) -> None:
        """Probe the lost external server `url` until it answers, then stage it (_readmit)."""
        if url in self._probes:
            return
        logger.warning("external engine %s dropped: probing its /health (backoff %.0f-%.0f s) to re-admit it", url,
                       READMIT_FIRST_S, READMIT_MAX_S)
        task = asyncio.get_running_loop().create_task(self._readmit(url), name=f"readmit {url}")
        self._probes[url] = task
        task.add_done_callback(lambda _: self._probes.pop(url, None))

    async def _readmit(self, url: str) -> None:
        """GET /health on `url` with backoff until it answers 200; then it is staged: it joins at the next weight
        update, which gives it the run's weights (whatever it holds now is never sampled from)."""
        delay = READMIT_FIRST_S
        while not await self.client.answers_health(url):
            await asyncio.sleep(delay)
            delay = min(READMIT_MAX_S, 2 * delay)
        self.client.stage_engine(url)
        logger.info("external engine %s answers /health again: re-admitted, it serves from the next weight update "
                    "on, with that update's weights", url)

    async def wait_for_restarts(self, timeout_s: float = 600.0) -> bool:
        """Wait until some engine is staged to join (a replacement started, a lost external server back), or none is
        being started or probed, or `timeout_s`; True when some engine is staged."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self.client.staged and (pending := self._restarts | set(self._probes.values())):
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        return bool(self.client.staged)

    def all_actors(self) -> list[Any]:
        """Every live actor (for shutdown)."""
        return list(self.actors.values())

    async def close(self) -> None:
        """Stop watching and restarting (before the actors are stopped on purpose)."""
        self._closed = True
        tasks = list(self._watchers.values()) + list(self._restarts) + list(self._probes.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _kill(actor: Any) -> None:
    import ray  # noqa: PLC0415

    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass
