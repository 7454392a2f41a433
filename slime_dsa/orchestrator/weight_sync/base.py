"""The weight-transport interface, and the one pause → update → continue routine that every transport runs."""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from typing import Any, Awaitable, Callable, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")


async def paused_update(client: Any, update: Callable[[], Awaitable[T]], pause_mode: str = "abort",
                        in_engine: bool = False) -> T:
    """Pause every engine of `client`, run `update`, continue; returns what `update` returned.

    Paused, no token is sampled from half-updated weights. pause_mode says what happens to requests in flight:
    abort (they end; the synchronous loop has none), retract or in_place (they continue under the new weights:
    the partial rollouts of the asynchronous loop; each token records the version that produced it).
    Continue is sent even when the pause or the update fails, and that failure is raised.

    in_engine: `update` is one request per engine that carries pause_mode (embedded engines): each engine pauses,
    updates and continues in one command between two of its steps, so no pause or continue request is sent.

    A lost engine does not stop the update: every engine that cannot be reached is dropped from the client and the
    rest go on (rollout.client.NoEnginesLeftError when none is left). Replacements staged since the last update
    are paused before they join, so they serve nothing until they hold this version.
    """
    try:
        await _pause_staged(client, pause_mode)
        if not in_engine:
            await client.broadcast("/pause_generation", {"mode": pause_mode}, drop_unreachable=True)
        client.admit_staged()
        result = await update()
    except BaseException:
        if client.engines:
            try:
                await client.broadcast("/continue_generation", {}, drop_unreachable=True)
            except Exception as e:  # noqa: BLE001 (the update's failure is the one to raise)
                logger.warning("continue_generation after a failed weight update failed too: %s", e)
        raise
    if not in_engine:
        await client.broadcast("/continue_generation", {}, drop_unreachable=True)
    return result


async def _pause_staged(client: Any, pause_mode: str) -> None:
    """Pause the replacements that join at this update (nothing routes to them yet); one that is gone is lost."""
    from rollout.client import EngineError  # noqa: PLC0415

    for url in client.staged:
        try:
            await client.post_to(url, "/pause_generation", {"mode": pause_mode})
        except EngineError as e:
            client.unstage(url, str(e))


class WeightUpdateRefusedError(RuntimeError):
    """Engines that were reached answered a weight update with an error status or {"success": false}."""


def check_replies(path: str, replies: dict[str, Any]) -> None:
    """WeightUpdateRefusedError naming each engine whose reply to `path` says {"success": false} (SGLang's update
    replies)."""
    refused = {url: body.get("message") for url, body in replies.items()
               if isinstance(body, dict) and body.get("success") is False}
    if refused:
        raise WeightUpdateRefusedError(f"{path} failed on {len(refused)} of {len(replies)} engines: "
                                       + "; ".join(f"{url} ({message})" for url, message in refused.items()))


async def post_update(client: Any, path: str, body: dict) -> dict[str, Any]:
    """POST one weight update to every engine; returns {url: reply}. An error status or {"success": false} raises
    WeightUpdateRefusedError, naming the engine. An engine that cannot be reached is dropped as lost (see
    paused_update)."""
    from rollout.client import EngineError, EngineUnavailableError  # noqa: PLC0415

    try:
        replies = await client.broadcast(path, body, drop_unreachable=True)
    except EngineUnavailableError:
        raise
    except EngineError as e:  # an engine answered 4xx or 5xx
        raise WeightUpdateRefusedError(str(e)) from None
    check_replies(path, replies)
    return replies


def with_pause(body: dict, pause_mode: str | None) -> dict:
    """`body` of an update request, asking the engine to pause in `pause_mode` and continue around it (when given)."""
    return body if pause_mode is None else {**body, "pause_mode": pause_mode}


class WeightTransport(ABC):
    """How the trainers' weights reach every engine. `push` is the same for every transport: `prepare` while the
    engines still generate, then `update` inside paused_update, then the state dict when asked."""

    name = ""  # what the logs call it: the rollout.weight_sync value it came from
    one_request = False  # whether `update` is a single request per engine (then it can carry the pause)

    def __init__(self, client: Any, trainers: Any) -> None:
        self.client = client  # rollout.client.EngineClient over every engine
        self.trainers = trainers  # a trainer group (trainers.base.TrainerBackend, fanned out over ranks)
        self.last_read_s = 0.0  # the last push's read_state seconds (0 when no state was wanted)
        # {url: reply} of the last push when its update request was each engine's last command (paused in the
        # engine), else None: embedded engines' replies carry their step-loop counters (orchestrator/perf.py).
        self.last_replies: dict[str, Any] | None = None
        # Set by build_weight_sync for engines that take pause_mode in their update request (this repo's embedded
        # engines): pause, update and continue are then one request per engine (paused_update's in_engine).
        self.engines_pause = False

    async def push(self, version: int, pause_mode: str = "abort", want_state: bool = False) -> dict | None:
        """Send the weights as `version`; returns the full state dict when `want_state` (else None)."""
        start = time.perf_counter()
        self.last_replies = None
        prepared = await self.prepare(version)
        if self.engines_pause and self.one_request:
            replies = await paused_update(self.client, lambda: self.update(version, prepared, pause_mode), pause_mode,
                                          in_engine=True)
            self.last_replies = replies if isinstance(replies, dict) else None
        else:
            await paused_update(self.client, lambda: self.update(version, prepared), pause_mode)
        self.client.weight_version = str(version)  # what every engine routed to holds now
        pushed = time.perf_counter()
        logger.info("weights v%d to %d engine(s) by %s in %.3fs", version, len(self.client.engines), self.name,
                    pushed - start)
        state = await self.read_state(prepared) if want_state else None
        self.last_read_s = time.perf_counter() - pushed if want_state else 0.0
        return state

    async def prepare(self, version: int) -> Any:
        """Work done before the pause, while engines still generate; its result goes to update and read_state."""
        return None

    @abstractmethod
    async def update(self, version: int, prepared: Any, pause_mode: str | None = None) -> dict[str, Any] | None:
        """Have every engine take the new weights as `version`: paused meanwhile, or, given a pause_mode (only when
        one_request), pausing in it and continuing within the update request itself. A one-request update returns
        the engines' replies ({url: body})."""

    async def read_state(self, prepared: Any) -> dict:
        """The full state dict just sent (for the on_weights hook): by default gathered again from the trainers."""
        return await asyncio.to_thread(self.trainers.full_state_dict)

    def close(self) -> None:
        """Free what the transport holds (idempotent)."""
