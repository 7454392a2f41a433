"""Run one real SGLang server as a subprocess: start, wait for /health, restart when it dies (bounded), stop."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from rollout.sglang.config import SGLangConfig, build_command

logger = logging.getLogger(__name__)


class SGLangLaunchError(RuntimeError):
    """The server exited or stayed unhealthy; the message carries the exit code and the log's tail."""


def _redact(cmd: list[str]) -> list[str]:
    return [("***" if i and cmd[i - 1] == "--api-key" else a) for i, a in enumerate(cmd)]


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def http_ok(url: str, timeout_s: float = 5.0) -> bool:
    """True when GET `url` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class SGLangServer:
    """One `python -m sglang.launch_server` process with a watchdog that restarts it up to `max_restarts` times."""

    def __init__(
        self,
        config: SGLangConfig,
        *,
        health_timeout_s: float = 1800.0,
        max_restarts: int = 3,
        log_path: str | Path | None = None,
        env: dict[str, str] | None = None,
        poll_interval_s: float = 2.0,
        command: list[str] | None = None,
    ) -> None:
        """`command` replaces the built argv (tests use it to run a labelled fake server)."""
        self.config = config.validate()
        self.command = command or build_command(config)
        self.health_timeout_s, self.max_restarts, self.poll_interval_s = health_timeout_s, max_restarts, poll_interval_s
        self.env = {**os.environ, **(env or {})}
        if log_path is None:
            log_path = Path(tempfile.gettempdir()) / f"sglang-{config.port}.log"
        self.log_path = Path(log_path)
        self.restarts = 0
        self.failed: str | None = None  # why the watchdog gave up
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watchdog: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> str:
        """Launch, wait for /health, start the watchdog; returns the server URL."""
        self._stopping.clear()
        self._launch()
        self.wait_healthy()
        self._watchdog = threading.Thread(target=self._watch, name=f"sglang-watchdog-{self.config.port}", daemon=True)
        self._watchdog.start()
        return self.url

    def _launch(self) -> None:
        with self._lock:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(self.log_path, "ab")
            logger.info("launching SGLang (log %s): %s", self.log_path, " ".join(_redact(self.command)))
            # own session: stop() signals the whole process group (SGLang forks scheduler/detokenizer processes)
            self._proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                          start_new_session=True)
            log.close()

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        """Poll /health until 200; SGLangLaunchError if the process exits or the timeout passes."""
        deadline = time.monotonic() + (timeout_s or self.health_timeout_s)
        while time.monotonic() < deadline:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                code = proc.returncode if proc else None
                raise SGLangLaunchError(f"SGLang server on port {self.config.port} exited with code {code} before "
                                        f"it was healthy; log tail ({self.log_path}):\n{_log_tail(self.log_path)}")
            if http_ok(self.url + "/health"):
                logger.info("SGLang server %s is healthy", self.url)
                return
            if self._stopping.wait(min(1.0, self.poll_interval_s)):
                raise SGLangLaunchError("stopped while waiting for the server to become healthy")
        raise SGLangLaunchError(f"SGLang server {self.url} not healthy after {timeout_s or self.health_timeout_s:.0f}s; "
                                f"log tail ({self.log_path}):\n{_log_tail(self.log_path)}")

    def _watch(self) -> None:
        while not self._stopping.wait(self.poll_interval_s):
            proc = self._proc
            if proc is None or proc.poll() is None:
                continue
            if self._stopping.is_set():
                return
            logger.error("SGLang server %s died with exit code %s; log tail:\n%s", self.url, proc.returncode,
                         _log_tail(self.log_path))
            if self.restarts >= self.max_restarts:
                self.failed = f"died {self.restarts + 1} times (exit code {proc.returncode}); max_restarts is {self.max_restarts}"
                logger.error("SGLang server %s: giving up, %s", self.url, self.failed)
                return
            self.restarts += 1
            logger.warning("restarting SGLang server %s (restart %d of %d)", self.url, self.restarts, self.max_restarts)
            try:
                self._launch()
                self.wait_healthy()
            except SGLangLaunchError as e:
                logger.error("restart %d of %s failed: %s", self.restarts, self.url, e)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the process group, SIGKILL after `timeout_s`; stops the watchdog first."""
        self._stopping.set()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=self.poll_interval_s + 5)
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                return
            for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    return
                try:
                    proc.wait(timeout=wait)
                    return
                except subprocess.TimeoutExpired:
                    logger.warning("SGLang server %s ignored %s", self.url, sig.name)
