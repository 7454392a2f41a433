"""One run per run directory: an exclusive flock on `<run_dir>/.lock`, which holds the holder's pid and host.

The kernel drops a flock when its process dies, SIGKILL included, so a lock left by a killed run is free: the next
run takes it over and says so. A live holder refuses the second run at once, in one line naming the directory and
the pid. The file is never removed (removing it would let two runs lock two different files of one name); a clean
release empties it. OutputLock, the lock of a directory that export, a convert tool, sft or indexer-warmup writes, lies
beside it and is removed on a clean release: a taker checks that the file it locked is still the one of that name.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
from pathlib import Path

from slime_dsa.config.errors import UserError
from slime_dsa.durable import older_leftovers, remove_leftovers

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"


class RunLock:
    """The exclusive lock of one run directory, taken by `acquire` and dropped by `release`."""

    def __init__(self, run_dir: Path, key: str = "logging.run_dir") -> None:
        self.run_dir = Path(run_dir)
        self.key = key  # the recipe key that names the directory (its errors say it)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None
        self.taken_over = ""  # '<pid> <host>' of a killed run whose lock this one took over ('' if none)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock; UserError naming the directory and the holder's pid when another run holds it, or the key
        and the system's reason when the directory cannot be written (a read-only filesystem, no permission)."""
        while True:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise UserError(f"{self.key}: cannot write {self.path.parent}: {e.strerror or e}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise UserError(self.in_use(_describe(read_holder(self.path)))) from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # unlinked by a holder that released it (OutputLock) after our open: lock the new file
        self.taken_over = _read_fd(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def in_use(self, holder: str) -> str:
        """The one line that refuses a second run while `holder` ('pid N') holds the lock."""
        what = "run directory" if self.key == "logging.run_dir" else self.key
        return (f"{what} {self.run_dir} is in use by another run ({holder}); wait for it to end or set {self.key} to "
                "another directory")

    def log_takeover(self) -> None:
        """One WARNING when this lock was left by a run that no longer holds it (call once the run's log is set up)."""
        if self.taken_over:
            logger.warning("run directory %s: took over the lock left by %s, which no longer holds it (killed?)",
                           self.run_dir, _describe(self.taken_over))

    def release(self) -> None:
        """Empty the file and drop the lock (idempotent)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing drops the flock

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class OutputLock(RunLock):
    """The lock of a directory that `slime-dsa export`, a convert tool, or sft and indexer-warmup (their model, from
    their start: run_dir.open_run_dir) write: `.NAME.lock` beside it, since the directory itself is replaced by a
    rename (slime_dsa/durable.py). A second writer of the same directory fails at once naming it and the holder's
    pid. A clean release removes the file (while still holding it: a writer that opened it meanwhile finds it gone
    and locks a new one); one left by a killed writer is taken over."""

    def __init__(self, out: Path, key: str = "") -> None:
        out = Path(os.path.abspath(out))  # '.' and '..' have no name to put beside
        super().__init__(out, key)
        self.path = out.with_name(f".{out.name}.lock")

    def acquire(self, clean_up: bool = True) -> None:
        """Take the lock, then (`clean_up`; else call clean_up later, once a run's log is set up) remove what killed
        writers of the directory left beside it."""
        super().acquire()
        if clean_up:
            self.clean_up()

    def clean_up(self) -> None:
        """Remove what killed writers of the directory left beside it (durable.remove_leftovers), saying so in one
        line. Only while holding the lock."""
        assert self.held, "OutputLock.clean_up without the lock"
        removed, restored = remove_leftovers(self.run_dir)
        done = ([f"renamed {restored.name} back to {self.run_dir.name}"] if restored else []) + (
            [f"removed {', '.join(path.name for path in removed)}"] if removed else [])
        if done:
            logger.info("%s: %s (left by a writer that was killed)", self.run_dir, " and ".join(done))
        if older := older_leftovers(self.run_dir):
            logger.warning("%s: left %s beside it: temporary directories of an older slime-dsa (no pid in the name), "
                           "which took no lock and may still be writing; remove them by hand once none writes %s",
                           self.run_dir, ", ".join(path.name for path in older), self.run_dir.name)

    def in_use(self, holder: str) -> str:
        named = f"{self.key} {self.run_dir}" if self.key else str(self.run_dir)
        return f"{named} is being written by another process ({holder}); wait for it to end or write elsewhere"

    def release(self) -> None:
        if self._fd is not None:
            self.path.unlink(missing_ok=True)
        super().release()


def read_holder(path: Path) -> str:
    """'<pid> <host>' of the lock file at `path`, or '' when empty or unreadable."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        here = os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino)


def _read_fd(fd: int) -> str:
    return os.pread(fd, 256, 0).decode(errors="replace").strip()


def _describe(holder: str) -> str:
    pid, _, host = holder.partition(" ")
    if not pid:
        return "pid unknown"
    return f"pid {pid}" + (f" on {host}" if host and host != socket.gethostname() else "")
