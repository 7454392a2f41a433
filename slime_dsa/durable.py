"""Writes that survive a crash or a power loss: what is written goes to a temporary name, is fsynced, then renamed
into place, and the directory holding it is fsynced after the rename. Without the first fsync the rename can reach
the disk before the data does, leaving a file or checkpoint that looks complete but holds zeros; without the last,
the rename itself can be lost. A directory that exists is replaced by swapping the two names in one step where
Linux can (publish_over)."""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's data and metadata to the disk (no byte is read)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """fsync every file under `directory`, then every directory, deepest first (a directory's entries name its
    files)."""
    for root, _, files in os.walk(directory, topdown=False):
        for name in files:
            if not os.path.islink(Path(root, name)):  # a link's target is not ours to flush (and may be dangling)
                fsync_path(Path(root, name))
        fsync_path(Path(root))


def publish(tmp: Path, final: Path) -> None:
    """Rename the written file or directory `tmp` to `final` durably: its contents fsynced, the rename, then the
    parent directory fsynced. `final`, when it exists, must be a file or an empty directory (os.replace's rule)."""
    if tmp.is_dir():
        fsync_tree(tmp)
    else:
        fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(final.parent)


def aside_path(final: Path) -> Path:
    """Where publish_over sets an existing `final` aside while its replacement is renamed in: `.NAME.old-PID`."""
    return final.with_name(f".{final.name}.old-{os.getpid()}")


def publish_over(tmp: Path, final: Path) -> None:
    """publish `tmp` as `final`, which may exist. On Linux the two swap names in one step (exchange): `final` never
    stops existing, and the old one, now at `tmp`'s name, is deleted after. Where the filesystem cannot swap, the old
    `final` is renamed aside (aside_path), the new one published, then the aside copy deleted: between the two renames
    `final` does not exist. A failure before the new one is in place renames the old one back; a crash there leaves
    `final` missing and the old one whole at its aside path, for the owner of `final` to rename back."""
    if not final.exists():
        publish(tmp, final)
        return
    if tmp.is_dir():
        fsync_tree(tmp)
    else:
        fsync_path(tmp)
    if exchange(tmp, final):
        fsync_path(final.parent)
        _remove(tmp)  # the old one; a kill before this leaves it for remove_leftovers
        return
    aside = aside_path(final)
    os.replace(final, aside)
    try:
        publish(tmp, final)
    except BaseException:
        if not final.exists():
            os.replace(aside, final)
        raise
    shutil.rmtree(aside, ignore_errors=True)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


def exchange(a: Path, b: Path) -> bool:
    """Swap the names `a` and `b` (both exist) in one step, Linux's renameat2(RENAME_EXCHANGE): True; False, with
    nothing changed, where the system (no renameat2: not Linux, glibc < 2.28) or the filesystem cannot."""
    error = _renameat2_exchange(a, b)
    if error == 0:
        return True
    if error in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(error, os.strerror(error), str(a), None, str(b))


def _renameat2_exchange(a: Path, b: Path) -> int:
    """0, or the errno of renameat2(a, b, RENAME_EXCHANGE) (ENOSYS where libc has none)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return errno.ENOSYS
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return 0
    return ctypes.get_errno()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def make_temp_dir(final: Path) -> Path:
    """A new empty directory beside `final` to write it in, `.NAME.tmp-PID-RANDOM`: the pid tells remove_leftovers
    whether the writer still runs."""
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))


def remove_leftovers(final: Path) -> tuple[list[Path], Path | None]:
    """What writers of `final` killed part way left beside it, whose process is gone: their temporary directories
    (make_temp_dir, `.NAME.tmp-PID-RANDOM`) and the old copies publish_over set aside (aside_path), removed. A live
    process's are its work in progress, and a name without a pid (an older version's: older_leftovers) is not ours to
    judge: both are left. When `final` is missing (a kill between publish_over's two renames), the newest old copy is
    renamed back to it first. Returns (removed, the copy renamed back or None). Only while holding the lock of `final`
    (run_lock.OutputLock)."""
    # tmp-PID- then the random part; old-PID and nothing after: an older `.NAME.tmp-12345678` (mkdtemp's random part,
    # all digits by chance) is not read as pid 12345678
    pattern = re.compile(rf"^\.{re.escape(final.name)}\.(?:tmp-(\d+)-|old-(\d+)$)")
    beside = sorted(final.parent.iterdir()) if final.parent.is_dir() else []
    dead = [("tmp" if match.group(1) else "old", path) for path in beside
            if (match := pattern.match(path.name)) and not _alive(int(match.group(1) or match.group(2)))]
    set_aside = [path for kind, path in dead if kind == "old" and path.is_dir()]
    restored = None
    if set_aside and not os.path.lexists(final):
        restored = max(set_aside, key=lambda path: path.stat().st_ctime)  # a rename sets ctime: the newest aside
        os.replace(restored, final)
        fsync_path(final.parent)
    removed = [path for _, path in dead if path != restored]
    for path in removed:
        _remove(path)
    return removed, restored


def older_leftovers(final: Path) -> list[Path]:
    """The temporary directories beside `final` named as versions before pids in the names named them,
    `.NAME.tmp-` and mkdtemp's 8 random characters. remove_leftovers leaves them: those versions took no lock, so
    holding the lock of `final` does not say that none of them is still writing there, and nothing in the name says
    whose it is. Removing a live writer's directory could publish part of a model (its files so far deleted, the
    directory kept because it wrote the next one meanwhile, then renamed into place by it)."""
    pattern = re.compile(rf"^\.{re.escape(final.name)}\.tmp-[a-z0-9_]{{8}}$")
    if not final.parent.is_dir():
        return []
    return [path for path in sorted(final.parent.iterdir()) if pattern.match(path.name) and path.is_dir()]


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (or might: another user's, which we may not signal)."""
    if pid <= 0:  # signal 0 to pid 0 would probe our own process group
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def set_aside_copies(final: Path) -> list[Path]:
    """The old copies of `final` that publish_over set aside and a crash left behind, oldest name first."""
    return sorted(final.parent.glob(f".{final.name}.old-*"))


def carry_over(old: Path, new: Path, keep: Callable[[str], bool]) -> None:
    """Hard-link (or copy, across filesystems) into `new` each entry of `old` that `new` lacks and `keep(name)`
    allows: the files of a directory about to be replaced that its writer does not write (a README)."""
    for item in old.iterdir():
        target = new / item.name
        if os.path.lexists(target) or not keep(item.name):
            continue
        if item.is_dir() and not item.is_symlink():
            shutil.copytree(item, target, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(item, target)


def _link_or_copy(source: str | Path, target: str | Path) -> None:
    if os.path.islink(source):
        os.symlink(os.readlink(source), target)
        return
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def write_directory(final: Path, write: Callable[[Path], object], keep: Callable[[str], bool]) -> None:
    """`write(tmp)` into a new directory beside `final`, carry over the entries of an existing `final` that `keep`
    allows, then publish_over: a failure or a kill at any point leaves no `final` that looks complete."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(final)
    try:
        write(tmp)
        apply_umask(tmp)  # before carry_over: the user's files keep their own modes
        if final.is_dir():
            carry_over(final, tmp, keep)
        publish_over(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def apply_umask(directory: Path) -> None:
    """Give `directory` and every directory and file under it the modes a plain mkdir and open would: mkdtemp makes a
    directory 0700 and safetensors writes its files 0600, which left an export or a conversion unreadable to any
    other user (a serving engine's). Links are left alone (chmod would change their targets)."""
    umask = os.umask(0o022)
    os.umask(umask)
    for root, directories, files in os.walk(directory):
        for name in files:
            if not os.path.islink(Path(root, name)):
                os.chmod(Path(root, name), 0o666 & ~umask)
        for name in directories:
            if not os.path.islink(Path(root, name)):
                os.chmod(Path(root, name), 0o777 & ~umask)
    os.chmod(directory, 0o777 & ~umask)


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text`: after a crash or a failed write (a full disk) it holds the old text or the new,
    never a part."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        publish(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


_OS_ERROR_IN_TEXT = re.compile(r"I/O error: (.+?) \(os error \d+\)")  # how safetensors reports a failed write


def write_problem(error: BaseException) -> str | None:
    """The operating system's words for a failed write (a full disk, a quota), or None for any other error. safetensors
    raises its own SafetensorError, no OSError, and says them in its text."""
    if isinstance(error, OSError):
        return error.strerror or str(error)
    match = _OS_ERROR_IN_TEXT.search(str(error))
    return match.group(1) if match else None


def write_failure(final: Path, error: BaseException) -> str | None:
    """Why the directory `final` could not be written, for one line after its name: a file where it or a directory
    above it should be, or the operating system's words (write_problem); None for an error that is no failed write
    (a bug, to keep its traceback)."""
    problem = write_problem(error)
    if problem is None:
        return None
    blocker = next((p for p in (Path(final), *Path(final).parents) if p.is_file()), None)
    return f"{blocker} is a file, not a directory" if blocker is not None else f"cannot be written: {problem}"


def creation_problem(final: Path) -> str | None:
    """Why the directory `final` could not be written by write_directory (or save_pretrained), found before any work:
    a file where it or a directory above it should be, or the nearest existing directory above it refuses a new
    entry, tried by making and removing one (modes do not stop root; a read-only mount does). None: it can be."""
    final = Path(final).absolute()
    if blocker := next((p for p in (final, *final.parents) if p.is_file()), None):
        return f"{blocker} is a file, not a directory"
    existing = next(p for p in final.parents if p.exists())
    try:
        Path(tempfile.mkdtemp(prefix=f".{final.name}.probe-", dir=existing)).rmdir()
    except OSError as e:
        return f"{existing} refuses new entries ({e.strerror or e})"
    return None
