"""Math answers checked by HF `math-verify` (`parse` + `verify`), in worker processes with a hard timeout.

math-verify's own timeout uses signal.alarm, which only works in a main thread, and sympy can hang on short inputs
(10^{10^{10}}). So each check runs in a worker of a pebble process pool (`_math_worker.check`), where the signal
timeout works, and a call that passes `timeout_s` gets its worker killed and replaced: one sample fails, nothing
else. Workers start lazily and are reused.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from pebble import ProcessExpired, ProcessPool

from rollout.rewards._math_worker import check, load
from rollout.rewards.answer import answer_text

logger = logging.getLogger(__name__)


class MathVerifyTimeout(TimeoutError):
    """A math-verify check took longer than the pool's hard timeout; its worker was killed."""


class MathVerifyPool:
    """Up to `max_workers` math-verify processes; `verify` is thread-safe and blocks while all are busy."""

    def __init__(self, max_workers: int = 2, timeout_s: float = 10.0, inner_timeout_s: int | None = None) -> None:
        if max_workers < 1 or timeout_s <= 0:
            raise ValueError(f"MathVerifyPool needs max_workers >= 1 ({max_workers}) and timeout_s > 0 ({timeout_s})")
        self.max_workers = max_workers
        self.timeout_s = timeout_s
        # math-verify's own (integer) timeout per parse/verify call: three calls fit in the hard timeout.
        self.inner_timeout_s = inner_timeout_s if inner_timeout_s is not None else max(1, int(timeout_s // 3))
        self._lock = threading.Lock()
        self._pool: ProcessPool | None = None
        self.num_killed = 0

    def verify(self, pred: str, gold: str) -> dict[str, bool]:
        """{'correct', 'pred_parsed', 'gold_parsed'} for a predicted and a ground-truth answer text."""
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPool(max_workers=self.max_workers, initializer=load,
                                         context=multiprocessing.get_context("spawn"))
            future = self._pool.schedule(check, args=(pred, gold, self.inner_timeout_s), timeout=self.timeout_s)
        try:
            return future.result()
        except FutureTimeout as exc:
            if exc.__cause__ is not None:  # math-verify's own, raised in the worker (pebble chains its traceback)
                raise RuntimeError(f"math-verify failed: {exc}") from exc
            self.num_killed += 1
            raise MathVerifyTimeout(f"math-verify took longer than {self.timeout_s:g}s; its worker was killed") from exc
        except ProcessExpired as exc:
            raise RuntimeError(f"math-verify worker died (exit code {exc.exitcode})") from exc
        except Exception as exc:
            raise RuntimeError(f"math-verify failed: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Stop the workers (running checks are killed); the next `verify` starts new ones."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            pool.join(timeout=10)


_pool: MathVerifyPool | None = None
_pool_lock = threading.Lock()


def get_math_verify_pool() -> MathVerifyPool:
    """The process-wide pool that `math_verify_reward` uses (created on first use, closed at exit)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = MathVerifyPool()
            atexit.register(_pool.close)
        return _pool


def verify_math(pred: str, gold: str) -> bool:
    """Whether math-verify finds the answer `pred` equal to `gold` (both LaTeX or plain text)."""
    return get_math_verify_pool().verify(pred, gold)["correct"]


def math_verify_reward(sample: Any, response: str, answer: Any, **metadata: Any) -> dict[str, float]:
    """1.0 when the (tagged, else final) answer equals `answer` by math-verify; an unparsable ground truth raises."""
    text, tagged = answer_text(response)
    reply = get_math_verify_pool().verify(text, str(answer))
    if not reply["gold_parsed"]:
        raise ValueError(f"math_verify: cannot parse the ground-truth answer {answer!r}")
    return {"reward": float(reply["correct"]), "answer_found": float(reply["pred_parsed"]),
            "answer_tagged": float(tagged)}
