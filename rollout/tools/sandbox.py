"""Run untrusted Python in a subprocess that can cost only itself: CPU, memory, process, file, wall and output limits.

Isolation, chosen once per process by a probe (`sandbox_mode()`):
- `netns`: the child runs under `unshare --net --pid --fork --kill-child`: a network namespace with only a loopback
  that is down (no network at all), and a pid namespace whose processes all die with it. As root the child also
  drops to uid/gid 65534 (nobody) with `setpriv`, because the kernel never applies RLIMIT_NPROC to uid 0; without
  root, `--user --map-root-user` comes first (unprivileged user namespaces), whose per-namespace process count
  RLIMIT_NPROC then bounds, and hard limits cannot be raised back from inside.
- `socket-block`: where namespaces are not allowed, the child replaces `socket.socket` and `_socket.socket` by a
  function that raises before it runs the code (a determined program could still reach the network through ctypes:
  prefer a kernel with user namespaces), and the run's process group is killed at the end.
Limits, set in the child before the code runs (soft = hard, so the code cannot raise them): RLIMIT_CPU (SIGKILL one
second past `cpu_s`), RLIMIT_AS (`memory_mb`: a 10 GB allocation raises MemoryError), RLIMIT_NPROC
(`max_processes`: a fork bomb's forks fail), RLIMIT_FSIZE, RLIMIT_NOFILE and no core files. The wall limit and the
output limit are the parent's: past either, the whole process group (and pid namespace) is SIGKILLed. The code runs
in a fresh temporary directory (removed afterwards) under `python -I -S` (no site-packages, no environment).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

NOBODY = 65534
_DRAIN_S = 5.0  # after the kill, how long the pipe may stay open

# Runs as the child's pid 1: sets the limits, forks the code's process and reports how it ended. A pid namespace's
# init ignores signals it has no handler for (os.kill(os.getpid(), SIGSEGV) would be a no-op), so the code is not it.
_BOOTSTRAP = r"""
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
def limit(name, value):
    resource.setrlimit(getattr(resource, name), (value, value))
resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))
limit("RLIMIT_AS", cfg["memory_bytes"])
limit("RLIMIT_FSIZE", cfg["file_bytes"])
limit("RLIMIT_NOFILE", 64)
limit("RLIMIT_CORE", 0)
nproc = cfg["max_processes"] + 1
if cfg["count_uid"]:
    uid = os.getuid()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                nproc += any(line.startswith("Uid:") and int(line.split()[1]) == uid for line in f)
        except (OSError, ValueError):
            pass
limit("RLIMIT_NPROC", nproc)
if cfg["block_network"]:
    import _socket, socket
    def _no_network(*args, **kwargs):
        raise PermissionError("network access is disabled in this sandbox")
    socket.socket = _socket.socket = socket.create_connection = _no_network
child = os.fork()
if child == 0:
    sys.argv = ["main.py"]
    with open("main.py", encoding="utf-8") as f:
        source = f.read()
    try:
        exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        sys.stdout.flush()
        os._exit(e.code if isinstance(e.code, int) else (0 if e.code is None else 1))
    except BaseException:
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
_, status = os.waitpid(child, 0)
os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
"""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. Defaults suit short maths/code snippets on a small machine."""

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512
    max_processes: int = 8
    max_output_bytes: int = 8192
    max_file_mb: int = 16

    @classmethod
    def from_config(cls, agent: Any) -> SandboxLimits:
        """From a recipe's AgentConfig (data.tasks.<i>.agent): its tool_* limits; the wall limit is tool_timeout_s,
        and the output limit leaves room for max_tool_output_chars characters of UTF-8."""
        return cls(cpu_s=agent.tool_cpu_s, wall_s=agent.tool_timeout_s, memory_mb=agent.tool_memory_mb,
                   max_processes=agent.tool_max_processes,
                   max_output_bytes=max(cls.max_output_bytes, 4 * agent.max_tool_output_chars))


@dataclass(frozen=True)
class SandboxResult:
    """How a run ended: its output (stdout and stderr interleaved, maybe cut) and why it stopped."""

    output: str
    exit_code: int | None  # None when the parent killed it (wall or output limit)
    signal: str | None = None  # the signal that ended the code, e.g. SIGKILL (CPU limit) or SIGSEGV
    timed_out: bool = False
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.truncated


@dataclass(frozen=True)
class _Mode:
    name: str  # netns | socket-block
    prefix: tuple[str, ...]
    python: str
    count_uid: bool  # RLIMIT_NPROC counts every process of the uid: add the ones already running


def _prefixes() -> list[tuple[str, tuple[str, ...], bool]]:
    """(mode, command prefix, count_uid) candidates, the strongest first."""
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    out = []
    if unshare:
        ns = ("--net", "--pid", "--fork", "--kill-child")
        if os.geteuid() == 0 and setpriv:
            drop = (setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--")
            out.append(("netns", (unshare, *ns, *drop), True))
        elif os.geteuid() != 0:
            out.append(("netns", (unshare, "--user", "--map-root-user", *ns), False))
    if os.geteuid() == 0 and setpriv:
        out.append(("socket-block", (setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"), True))
    out.append(("socket-block", (), True))
    return out


def _works(prefix: tuple[str, ...], python: str) -> bool:
    try:
        done = subprocess.run([*prefix, python, "-I", "-S", "-c", "pass"], capture_output=True, timeout=20,
                              cwd=tempfile.gettempdir())
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@functools.cache
def _mode() -> _Mode:
    pythons = list(dict.fromkeys(p for p in (sys.executable, shutil.which("python3"), "/usr/bin/python3") if p))
    for name, prefix, count_uid in _prefixes():
        for python in pythons:
            if _works(prefix, python):
                logger.info("python sandbox: %s isolation, interpreter %s", name, python)
                return _Mode(name, prefix, python, count_uid)
    raise RuntimeError(f"python sandbox: no interpreter among {pythons} runs")


def sandbox_mode() -> str:
    """The isolation this machine allows: netns or socket-block (see the module docstring)."""
    return _mode().name


async def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` as a script in a fresh sandbox; never raises for what the code does."""
    mode = await asyncio.to_thread(_mode)  # the first call probes (subprocesses): off the event loop
    cfg = {"cpu_s": limits.cpu_s, "memory_bytes": limits.memory_mb << 20, "file_bytes": limits.max_file_mb << 20,
           "max_processes": limits.max_processes, "count_uid": mode.count_uid,
           "block_network": mode.name == "socket-block"}
    with tempfile.TemporaryDirectory(prefix="slime-sandbox-") as workdir:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        if mode.prefix and mode.prefix[-1] == "--":  # setpriv drops to nobody: the directory must be its
            os.chown(workdir, NOBODY, NOBODY)
            os.chmod(workdir, 0o700)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
        proc = await asyncio.create_subprocess_exec(
            *mode.prefix, mode.python, "-I", "-S", "-c", _BOOTSTRAP, json.dumps(cfg), cwd=workdir, env=env,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True)
        chunks: list[bytes] = []
        truncated = timed_out = False
        try:
            truncated = await asyncio.wait_for(_read(proc, chunks, limits.max_output_bytes), limits.wall_s)
        except asyncio.TimeoutError:
            timed_out = True
        finally:  # also when the caller is cancelled: the run never outlives its call
            if truncated or timed_out or proc.returncode is None:
                _kill(proc)
            await _discard_output(proc)
            code_ = await proc.wait()
    output = b"".join(chunks)[: limits.max_output_bytes].decode("utf-8", errors="replace")
    if truncated or timed_out:
        return SandboxResult(output, None, "SIGKILL", timed_out=timed_out, truncated=truncated)
    if code_ < 0 or code_ > 128:  # killed itself (no pid namespace: negative) or via the bootstrap: 128 + signal
        number = -code_ if code_ < 0 else code_ - 128
        return SandboxResult(output, code_, _signal_name(number))
    return SandboxResult(output, code_)


async def _read(proc: asyncio.subprocess.Process, chunks: list[bytes], limit: int) -> bool:
    """Collect output until EOF (False) or past `limit` bytes (True); then wait for the exit."""
    size = 0
    while chunk := await proc.stdout.read(65536):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return True
    await proc.wait()
    return False


async def _discard_output(proc: asyncio.subprocess.Process) -> None:
    """Read the pipe to EOF, so that `wait()` returns: it waits for the pipe's close, which a full, paused pipe
    never reports. A writer outside the killed process group could hold it open: then the transport is closed."""
    async def to_eof() -> None:
        while await proc.stdout.read(1 << 20):
            pass
    try:
        await asyncio.wait_for(to_eof(), _DRAIN_S)
    except asyncio.TimeoutError:
        proc._transport.close()  # no public way to drop a subprocess's pipes


def _kill(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
