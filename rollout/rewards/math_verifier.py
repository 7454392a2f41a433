"""Math answers checked by HF `math-verify` (`parse` + `verify`), in child processes with a hard timeout.

math-verify's own timeout uses signal.alarm, which only works in a main thread, and sympy can hang on short inputs
(10^{10^{10}}). So each check runs in a long-lived worker process (`_math_worker.py`) where the signal timeout
works, and a reply that is late past `timeout_s` gets the worker killed and replaced: one sample fails, nothing
else. Workers start lazily (about half a second each) and are reused.
"""

from __future__ import annotations

import atexit
import json
import logging
import queue
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from rollout.rewards.answer import answer_text

logger = logging.getLogger(__name__)

_WORKER_SCRIPT = str(Path(__file__).with_name("_math_worker.py"))


class MathVerifyTimeout(TimeoutError):
    """A math-verify check took longer than the pool's hard timeout; its worker was killed."""


class _Worker:
    """One child process speaking JSON lines."""

    def __init__(self, startup_timeout_s: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-u", _WORKER_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        try:
            if self._readline(startup_timeout_s) != "ready":
                raise RuntimeError("math-verify worker did not start (is math-verify installed?)")
        except BaseException:
            self.kill()
            raise

    def request(self, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(payload) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as exc:
            raise RuntimeError(f"math-verify worker is gone (exit code {self.proc.poll()})") from exc
        return json.loads(self._readline(timeout_s))

    def _readline(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        # One reply line per request, read whole: the reader's buffer is empty whenever we select on the pipe.
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise MathVerifyTimeout(f"math-verify took longer than {timeout_s:g}s; its worker was killed")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"math-verify worker exited (code {self.proc.wait()})")
        return line.decode().strip()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the worker's loop ends at EOF
            self.proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()


class MathVerifyPool:
    """Up to `max_workers` math-verify processes; `verify` is thread-safe and blocks while all are busy."""

    def __init__(self, max_workers: int = 2, timeout_s: float = 10.0, inner_timeout_s: int | None = None,
                 startup_timeout_s: float = 60.0) -> None:
        if max_workers < 1 or timeout_s <= 0:
            raise ValueError(f"MathVerifyPool needs max_workers >= 1 ({max_workers}) and timeout_s > 0 ({timeout_s})")
        self.timeout_s = timeout_s
        # math-verify's own (integer) timeout per parse/verify call: three calls fit in the hard timeout.
        self.inner_timeout_s = inner_timeout_s if inner_timeout_s is not None else max(1, int(timeout_s // 3))
        self.startup_timeout_s = startup_timeout_s
        self._slots = threading.BoundedSemaphore(max_workers)
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self.num_killed = 0

    def verify(self, pred: str, gold: str) -> dict[str, bool]:
        """{'correct', 'pred_parsed', 'gold_parsed'} for a predicted and a ground-truth answer text."""
        payload = {"pred": pred, "gold": gold, "timeout": self.inner_timeout_s}
        with self._slots:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                worker = _Worker(self.startup_timeout_s)
            try:
                reply = worker.request(payload, self.timeout_s)
            except BaseException:
                worker.kill()
                self.num_killed += 1
                raise
            self._idle.put(worker)
        if "error" in reply:
            raise RuntimeError(f"math-verify failed: {reply['error']}")
        return reply

    def close(self) -> None:
        """Stop the idle workers (busy ones stop when their pipe closes with this process)."""
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return


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
