"""`compute_reward`: score one sample without ever raising — a failing reward costs that sample, not the run.

Every call has a deadline (`timeout_s`, the recipe's rollout.reward_timeout_s). Where a call runs is the reward
function's `isolation` (registry.py): worker processes killed and replaced at the deadline (pool.py), threads, inline,
or, for async functions, the plugin loop in a helper thread, abandoned for a fresh one when a coroutine blocks it
(rollout/plugin_loop.py). A raise, a timeout or a malformed return value gives reward 0.0 with `failed=True` and the
error, counted in `RewardStats` and logged with the task and sample index (rate-limited); `reward_step_metrics` turns
a step's counts into metrics and warns when more than the recipe's share of the step's calls timed out.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import inspect
import logging
import math
import numbers
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from rollout.plugin_loop import PluginTimeout, run_on_plugin_loop
from rollout.rewards.pool import CallTimeout, close_reward_pools, reward_pools
from rollout.rewards.registry import RewardFunction, load_reward_fn
from slime_dsa.data.sample import Sample

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
_LOG_FIRST_FAILURES = 5  # per reward function; after those, one line per _LOG_EVERY failures
_LOG_EVERY = 100


@dataclass
class RewardResult:
    """What one reward call produced: the reward (0.0 on failure), extra metrics, and the failure if any."""

    reward: float
    failed: bool = False
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    elapsed_s: float = 0.0
    timed_out: bool = False


@dataclass
class RewardStats:
    """Counters over many reward calls (one per task or per step), for the logs."""

    calls: int = 0
    failures: int = 0
    timeouts: int = 0
    total_s: float = 0.0

    def add(self, result: RewardResult) -> None:
        self.calls += 1
        self.failures += int(result.failed)
        self.timeouts += int(result.timed_out)
        self.total_s += result.elapsed_s

    def as_metrics(self, prefix: str = "reward/") -> dict[str, float]:
        return {f"{prefix}calls": self.calls, f"{prefix}failures": self.failures,
                f"{prefix}timeouts": self.timeouts,
                f"{prefix}mean_time_s": self.total_s / self.calls if self.calls else 0.0}


def reward_step_metrics(stats: Mapping[str, RewardStats], timeout_warn_share: float) -> dict[str, float]:
    """rollout/reward_failures and rollout/reward_timeouts of one step (`stats` by task); a WARNING when more than
    `timeout_warn_share` of the step's reward calls timed out."""
    calls = sum(st.calls for st in stats.values())
    timeouts = sum(st.timeouts for st in stats.values())
    if calls and timeouts / calls > timeout_warn_share:
        per_task = ", ".join(f"{task}: {st.timeouts} of {st.calls}" for task, st in stats.items() if st.timeouts)
        logger.warning("%d of %d reward calls (%.1f%%) timed out this step (%s), more than "
                       "rollout.reward_timeout_warn_share (%.1f%%); they scored 0. Is a reward function hanging, or "
                       "is rollout.reward_timeout_s too short?", timeouts, calls, 100 * timeouts / calls, per_task,
                       100 * timeout_warn_share)
    return {"rollout/reward_failures": sum(st.failures for st in stats.values()), "rollout/reward_timeouts": timeouts}


def close_reward_pool() -> None:
    """Stop the reward worker processes and threads (they start again on the next call)."""
    close_reward_pools()


_failure_counts: Counter[str] = Counter()


def _is_real(value: Any) -> bool:
    """isinstance(value, numbers.Real), with the builtin types checked first (the ABC's check costs more)."""
    return isinstance(value, (float, int)) or isinstance(value, numbers.Real)


def _normalise(value: Any) -> tuple[float, dict[str, float]]:
    """(reward, metrics) from a number or a {"reward": number, metric: number, ...} dict; raises if neither."""
    metrics: dict[str, float] = {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise ValueError(f"returned a dict without a 'reward' key (keys: {sorted(map(str, value))})")
        metrics = {str(k): float(v) for k, v in value.items() if k != "reward" and _is_real(v)}
        value = value["reward"]
    if not _is_real(value):
        raise TypeError(f"returned {type(value).__name__}, not a number or a dict with a 'reward' key")
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"returned a non-finite reward {reward}")
    return reward, metrics


def _log_failure(name: str, sample: Sample, error: str, exc: BaseException | None) -> None:
    _failure_counts[name] += 1
    count = _failure_counts[name]
    if count <= _LOG_FIRST_FAILURES or count % _LOG_EVERY == 0:
        logger.warning("reward function %s failed on sample %s (task %r): %s [%d failure(s) so far]",
                       name, sample.index, sample.task, error, count, exc_info=exc if count == 1 else None)


async def compute_reward(
    reward_fn: RewardFunction | Callable[..., Any] | str,
    sample: Sample,
    *,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    stats: RewardStats | None = None,
) -> RewardResult:
    """Call `reward_fn(sample, sample.response_text, sample.answer, **sample.metadata)` under a deadline.

    Never raises for what the function does (raise, timeout, bad return: reward 0.0, failed); only a `str` spec
    that does not resolve raises RewardLoadError. Resolve specs once with `load_reward_fn` at startup.
    """
    if not isinstance(reward_fn, RewardFunction):
        reward_fn = load_reward_fn(reward_fn) if isinstance(reward_fn, str) else RewardFunction.wrap(reward_fn)
    start = time.perf_counter()
    error: str | None = None
    exc: BaseException | None = None
    try:
        reward, metrics = _normalise(await _call(reward_fn, sample, timeout_s))
    except (Exception, SystemExit) as e:  # noqa: BLE001 - any failure of user code costs this sample only
        error, exc = (str(e) if isinstance(e, CallTimeout) else f"{type(e).__name__}: {e}"), e
    result = (RewardResult(reward, metrics=metrics) if error is None
              else RewardResult(0.0, failed=True, error=error, timed_out=isinstance(exc, CallTimeout)))
    result.elapsed_s = time.perf_counter() - start
    if error is not None:
        _log_failure(reward_fn.name, sample, error, None if isinstance(exc, CallTimeout) else exc)
    if stats is not None:
        stats.add(result)
    return result


async def _call(reward_fn: RewardFunction, sample: Sample, timeout_s: float | None) -> Any:
    kwargs = reward_fn.metadata_kwargs(sample.metadata)
    if reward_fn.is_async:
        value = await _on_plugin_loop(reward_fn.fn(sample, sample.response_text, sample.answer, **kwargs), reward_fn,
                                      timeout_s)
    elif reward_fn.isolation == "inline":
        value = reward_fn.fn(sample, sample.response_text, sample.answer, **kwargs)
    elif reward_fn.isolation == "process":
        args = (_portable(sample), sample.response_text, sample.answer)
        value = await asyncio.wrap_future(reward_pools().run_in_process(reward_fn.spec, args, kwargs, timeout_s))
    else:
        future = reward_pools().run_in_thread(reward_fn.fn, (sample, sample.response_text, sample.answer), kwargs)
        try:
            value = await _with_deadline(asyncio.wrap_future(future), timeout_s)
        except CallTimeout:
            reward_pools().abandon(future)
            raise
    if asyncio.iscoroutine(value):  # a sync callable that returned a coroutine (e.g. a lambda around an async fn)
        value = await _on_plugin_loop(value, reward_fn, timeout_s)
    elif inspect.isawaitable(value):  # a future of this loop, say: it can only be awaited here
        value = await _with_deadline(_contained(value), timeout_s)
    return value


async def _on_plugin_loop(coro: Coroutine[Any, Any, Any], reward_fn: RewardFunction, timeout_s: float | None) -> Any:
    """`coro` run on the plugin loop (rollout/plugin_loop.py), so that one that blocks its loop stalls that loop, not
    the rollout's; CallTimeout past the deadline."""
    try:
        return await run_on_plugin_loop(coro, timeout_s, what=f"reward function {reward_fn.name}")
    except PluginTimeout:
        raise CallTimeout(f"timed out after {timeout_s:g}s") from None


async def _contained(awaitable: Awaitable[Any]) -> Any:
    """`awaitable`'s result, with a SystemExit it raises turned into a RuntimeError here, inside the task that
    `_with_deadline` makes: a task re-raises a SystemExit out of the event loop, which would end the run."""
    try:
        return await awaitable
    except SystemExit as e:
        raise RuntimeError(f"raised SystemExit({e})") from None


async def _with_deadline(awaitable: Awaitable[Any], timeout_s: float | None) -> Any:
    """Await under the deadline; CallTimeout when it passes (a TimeoutError the function raises is its own)."""
    start = time.perf_counter()
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except (asyncio.TimeoutError, concurrent.futures.TimeoutError):
        if timeout_s is not None and time.perf_counter() - start >= timeout_s:
            raise CallTimeout(f"timed out after {timeout_s:g}s") from None
        raise


def _portable(sample: Sample) -> Sample:
    """The copy a worker process gets: without the index-replay arrays, which no verifier reads."""
    light = copy.copy(sample)
    light.indexer_topk = None
    return light
