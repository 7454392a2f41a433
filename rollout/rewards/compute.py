"""`compute_reward`: score one sample without ever raising — a failing reward costs that sample, not the run.

Sync functions run in a dedicated thread pool (so a hung one cannot starve the event loop's default executor),
async ones are awaited; both under a timeout. A raise, a timeout or a malformed return value gives reward 0.0
with `failed=True` and the error, counted in `RewardStats` and logged (rate-limited).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import numbers
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

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
        self.timeouts += int(result.failed and (result.error or "").startswith("timed out"))
        self.total_s += result.elapsed_s

    def as_metrics(self, prefix: str = "reward/") -> dict[str, float]:
        return {f"{prefix}calls": self.calls, f"{prefix}failures": self.failures,
                f"{prefix}timeouts": self.timeouts,
                f"{prefix}mean_time_s": self.total_s / self.calls if self.calls else 0.0}


_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()
_failure_counts: Counter[str] = Counter()


def _reward_executor() -> ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=min(32, (os.cpu_count() or 1) + 4), thread_name_prefix="reward")
        return _executor


def _normalise(value: Any) -> tuple[float, dict[str, float]]:
    """(reward, metrics) from a number or a {"reward": number, metric: number, ...} dict; raises if neither."""
    metrics: dict[str, float] = {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise ValueError(f"returned a dict without a 'reward' key (keys: {sorted(map(str, value))})")
        metrics = {str(k): float(v) for k, v in value.items() if k != "reward" and isinstance(v, numbers.Real)}
        value = value["reward"]
    if not isinstance(value, numbers.Real):
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
    """Call `reward_fn(sample, sample.response_text, sample.answer, **sample.metadata)`.

    Never raises for what the function does (raise, timeout, bad return: reward 0.0, failed); only a `str` spec
    that does not resolve raises RewardLoadError. Resolve specs once with `load_reward_fn` at startup.
    """
    if not isinstance(reward_fn, RewardFunction):
        reward_fn = load_reward_fn(reward_fn) if isinstance(reward_fn, str) else RewardFunction.wrap(reward_fn)
    start = time.perf_counter()
    error: str | None = None
    exc: BaseException | None = None
    try:
        value = await asyncio.wait_for(_call(reward_fn, sample), timeout_s)
        reward, metrics = _normalise(value)
    except asyncio.TimeoutError as e:
        # Ours only if the deadline passed; a TimeoutError the function itself raised is reported as its own.
        ours = timeout_s is not None and time.perf_counter() - start >= timeout_s
        error, exc = (f"timed out after {timeout_s:g}s" if ours else f"{type(e).__name__}: {e}"), e
    except Exception as e:  # noqa: BLE001 - any failure of user code costs this sample only
        error, exc = f"{type(e).__name__}: {e}", e
    result = (RewardResult(reward, metrics=metrics) if error is None
              else RewardResult(0.0, failed=True, error=error))
    result.elapsed_s = time.perf_counter() - start
    if error is not None:
        _log_failure(reward_fn.name, sample, error, exc)
    if stats is not None:
        stats.add(result)
    return result


async def _call(reward_fn: RewardFunction, sample: Sample) -> Any:
    args = (sample, sample.response_text, sample.answer)
    kwargs = reward_fn.metadata_kwargs(sample.metadata)
    if reward_fn.is_async:
        value = await reward_fn.fn(*args, **kwargs)
    else:
        loop = asyncio.get_running_loop()
        value = await loop.run_in_executor(_reward_executor(), functools.partial(reward_fn.fn, *args, **kwargs))
    if inspect.isawaitable(value):  # a sync callable that returned a coroutine (e.g. a lambda around an async fn)
        value = await value
    return value
