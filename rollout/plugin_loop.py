"""The plugin loop: an event loop in a helper thread where async plugin code runs (async reward functions, the `call`
of tools given by import path under tool_isolation inline), so that a coroutine that blocks its loop (time.sleep, a
busy loop, blocking I/O) stalls that loop, never the rollout's.

`run_on_plugin_loop(coro, timeout_s)` starts `coro` there (asyncio.run_coroutine_threadsafe) and awaits it from the
caller's loop under the deadline; at the deadline the call is cancelled and PluginTimeout raised. Plugins must still
not block: one that does stalls every call running on the plugin loop with it. When a call passes its deadline and
the loop then does not run a no-op within PROBE_S, the loop is stuck: its thread is abandoned (a thread cannot be
killed; it ends once the blocking call returns), a WARNING says so, and a fresh loop in a fresh thread takes the
next calls. Calls still waiting to start on the stuck loop move to the fresh one; calls that were running there end
at their deadlines. One loop thread per process, started on first use.

On a loop of its own, a plugin's coroutine cannot await futures of the caller's loop, and an async client it keeps
between calls (an aiohttp session, say) is tied to the plugin loop: after a stuck loop is replaced, make a new one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
from collections.abc import Coroutine
from typing import Any

logger = logging.getLogger(__name__)

PROBE_S = 1.0  # a plugin loop that does not run a no-op this long after a call's deadline is stuck


class PluginTimeout(TimeoutError):
    """A call on the plugin loop passed its deadline (the call was cancelled; its loop, if stuck, abandoned)."""


class _LoopThread:
    """One event loop running in a daemon thread until it is abandoned and its tasks have ended."""

    _numbers = itertools.count(1)

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.name = f"plugin-loop-{next(self._numbers)}"
        self.abandoned = False
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = set()  # told when it is abandoned
        self.thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()
            if self.abandoned:
                logger.info("plugin loop: abandoned thread %s has ended", self.name)

    def usable(self) -> bool:
        return not self.abandoned and self.thread.is_alive() and not self.loop.is_closed()

    def when_abandoned(self, caller: asyncio.AbstractEventLoop) -> asyncio.Future:
        """A future of `caller`'s loop, done once this loop is abandoned (`forget` it after use)."""
        future = caller.create_future()
        with self._lock:
            if self.abandoned:
                future.set_result(None)
            else:
                self._waiters.add((caller, future))
        return future

    def forget(self, future: asyncio.Future) -> None:
        with self._lock:
            self._waiters.discard((future.get_loop(), future))

    async def responsive(self) -> bool:
        """Whether this loop runs a no-op within PROBE_S."""
        probe: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self.loop.call_soon_threadsafe(_answer, probe)
        except RuntimeError:  # closed: a plugin stopped it
            return False
        try:
            await asyncio.wait_for(asyncio.wrap_future(probe), PROBE_S)
        except TimeoutError:
            return False
        return True

    def abandon(self) -> bool:
        """Mark this loop abandoned (False if it already was): its waiters are told, and once it runs again it
        stops after its last task."""
        with self._lock:
            if self.abandoned:
                return False
            self.abandoned = True
            waiters, self._waiters = self._waiters, set()
        for caller, future in waiters:
            try:
                caller.call_soon_threadsafe(_resolve, future)
            except RuntimeError:  # that caller's loop has closed
                pass
        try:
            self.loop.call_soon_threadsafe(self._wind_down)
        except RuntimeError:
            pass
        return True

    def _wind_down(self) -> None:
        async def after_last_task() -> None:
            while others := asyncio.all_tasks(self.loop) - {asyncio.current_task()}:
                await asyncio.wait(others)
            self.loop.stop()

        self.loop.create_task(after_last_task())


def _answer(probe: concurrent.futures.Future) -> None:
    if probe.set_running_or_notify_cancel():
        probe.set_result(None)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class _Call:
    """One coroutine on its way to a plugin loop: it starts on the loop it was last given (`runner`), at most once;
    `future` (of the caller's loop) is its outcome there."""

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self.coro = coro
        self.started = False
        self.runner: _LoopThread | None = None
        self.future: asyncio.Future | None = None
        self._lock = threading.Lock()

    def submit(self, runner: _LoopThread) -> bool:
        """Start the call on `runner`'s loop, unless it has started elsewhere (False then)."""
        with self._lock:
            if self.started:
                return False
            self.runner = runner
        wrapper = self._run(runner)
        try:
            future = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(wrapper, runner.loop))
        except RuntimeError:  # that loop closed a moment ago
            wrapper.close()
            raise
        if self.future is not None:
            self.future.cancel()  # the abandoned loop's wrapper: it would not start the call anyway
        self.future = future
        return True

    async def _run(self, runner: _LoopThread) -> Any:
        with self._lock:
            if self.started or self.runner is not runner:
                return None  # moved to another loop, or dropped, before this loop got to it
            self.started = True
        try:
            return await self.coro
        except (SystemExit, KeyboardInterrupt) as e:  # would end the loop's thread (and its other calls) instead
            raise RuntimeError(f"raised {type(e).__name__}({e})") from None

    async def settle(self, caller: asyncio.AbstractEventLoop, deadline: float | None) -> bool:
        """Wait until the call ends (True) or the deadline passes (False); a call whose loop is abandoned before it
        started there moves to a fresh loop."""
        while True:
            runner = self.runner
            abandoned = None if self.started else runner.when_abandoned(caller)
            try:
                await asyncio.wait({self.future} | ({abandoned} if abandoned else set()),
                                   timeout=None if deadline is None else max(0.0, deadline - caller.time()),
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                if abandoned is not None:
                    runner.forget(abandoned)
            if self.future.done():
                return True
            if abandoned is None or not abandoned.done():
                return False
            self.submit(_plugin_loop())  # False when it started on the abandoned loop meanwhile: wait on there

    def cancel(self) -> None:
        """Cancel the call where it runs, or never start it."""
        self.future.cancel()
        with self._lock:
            if self.started:
                return
            self.started = True  # so that no loop starts it
        self.coro.close()


_current: _LoopThread | None = None
_current_lock = threading.Lock()
_abandoned = 0


def _plugin_loop() -> _LoopThread:
    """The process's plugin loop (a fresh one after the last was abandoned, or in a forked child)."""
    global _current
    with _current_lock:
        if _current is None or not _current.usable():
            _current = _LoopThread()
        return _current


def abandoned_threads() -> int:
    """How many stuck plugin loop threads this process has abandoned."""
    return _abandoned


async def run_on_plugin_loop(coro: Coroutine[Any, Any, Any], timeout_s: float | None, what: str = "a call") -> Any:
    """`coro`'s result, run on the plugin loop; PluginTimeout past `timeout_s` (None: no deadline). `what` names the
    call in the warning about a stuck loop."""
    caller = asyncio.get_running_loop()
    deadline = None if timeout_s is None else caller.time() + timeout_s
    call = _Call(coro)
    call.submit(_plugin_loop())
    try:
        ended = await call.settle(caller, deadline)
    except BaseException:  # the caller was cancelled
        call.cancel()
        raise
    if ended:
        if call.future.cancelled():  # the coroutine cancelled itself: its failure, not the caller's cancellation
            raise RuntimeError("it was cancelled on the plugin loop")
        return call.future.result()
    call.cancel()
    runner = call.runner
    if runner is not None and not runner.abandoned and not await runner.responsive() and runner.abandon():
        _note_abandoned(runner, what, timeout_s)
    raise PluginTimeout(f"timed out after {timeout_s:g}s")


def _note_abandoned(runner: _LoopThread, what: str, timeout_s: float | None) -> None:
    global _abandoned
    with _current_lock:
        _abandoned += 1
        count = _abandoned
    logger.warning("plugin loop stuck: %s passed its %gs deadline and the loop has not run for %gs since, so a "
                   "coroutine on it blocks (time.sleep, a busy loop, blocking I/O where it should await). Its thread "
                   "%s is abandoned (a thread cannot be killed: it ends if that call returns, and one that spins "
                   "keeps a share of the CPU; work that may hang belongs in a subprocess) and a fresh loop takes the "
                   "next calls; calls that were running on it end at their deadlines [%d thread(s) abandoned so far]",
                   what, timeout_s, PROBE_S, runner.name, count)
