"""One process's torch.profiler trace of a window of work (an RL step), written where a timeline can merge it with
the other processes' (slime_dsa/logging/timeline.py); and `annotate`, the named ranges engines and trainers mark.

Each trace is a Kineto chrome trace, `<name>.trace.json.gz`, beside `<name>.meta.json` with the process's GPU (its
UUID: processes on one GPU are merged into one device timeline) and host. Kineto's timestamps are on the wall clock
(`baseTimeNanoseconds` + ts), so traces of processes on one host line up.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import platform
import re
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

TRACE_SUFFIX = ".trace.json.gz"
ACTIVITIES = ("CPU", "GPU")  # SGLang's /start_profile names
META_SUFFIX = ".meta.json"
_NOTHING = object()  # the "profiler" of a GPU-only recording without a GPU
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


def annotate(name: str) -> AbstractContextManager:
    """A named range in the trace while a profiler records this thread; nothing (not even the op call) otherwise."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return nullcontext()


class ProfileError(ValueError):
    """A profile request that cannot be honoured (one already running, none to stop, a bad name)."""


def gpu_identity() -> dict[str, Any]:
    """This process's current CUDA device: its index, UUID and name (empty without a GPU)."""
    from slime_dsa.weights.cuda_ipc import device_uuid  # noqa: PLC0415

    if not torch.cuda.is_available():
        return {}
    index = torch.cuda.current_device()
    return {"gpu_index": index, "gpu_uuid": device_uuid(), "gpu_name": torch.cuda.get_device_name(index)}


class TraceRecorder:
    """torch.profiler over CPU ops and, with a GPU, its kernels, between start() and stop()."""

    def __init__(self) -> None:
        self._profiler: Any = None
        self._dir: Path | None = None
        self._name = ""

    @property
    def running(self) -> bool:
        return self._profiler is not None

    def start(self, directory: str | Path, name: str, activities: Sequence[str] = ACTIVITIES) -> None:
        """Start recording `activities` (CPU: the ops and ranges of this thread; GPU: every kernel and copy of the
        process, when it has a GPU); stop() writes `<directory>/<name>.trace.json.gz`. ProfileError if one is
        running."""
        from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

        if self.running:
            raise ProfileError("a profile is already being recorded; stop it first")
        if not _NAME.match(name):
            raise ProfileError(f"profile name must be 1-100 characters of letters, digits, '_', '.', '-'; got {name!r}")
        if not activities or not set(activities) <= set(ACTIVITIES):
            raise ProfileError(f"activities must be a non-empty subset of {list(ACTIVITIES)}, got {list(activities)}")
        kinds = [ProfilerActivity.CPU] if "CPU" in activities else []
        if "GPU" in activities and torch.cuda.is_available():
            kinds.append(ProfilerActivity.CUDA)
        self._dir, self._name = Path(directory), name
        self._dir.mkdir(parents=True, exist_ok=True)
        # GPU only on a machine without one: nothing to record, and stop() writes an empty trace
        self._profiler = profile(activities=kinds) if kinds else _NOTHING
        if kinds:
            self._profiler.start()

    def stop(self) -> Path:
        """Stop recording and write the trace and its meta file; returns the trace's path. ProfileError if none."""
        if self._profiler is None or self._dir is None:
            raise ProfileError("no profile is being recorded")
        profiler, self._profiler = self._profiler, None
        path = self._dir / f"{self._name}{TRACE_SUFFIX}"
        partial = path.with_name(f".{path.name}.partial.json.gz")
        if profiler is _NOTHING:
            partial.write_bytes(gzip.compress(json.dumps({"traceEvents": []}).encode()))
        else:
            profiler.stop()
            profiler.export_chrome_trace(str(partial))
        os.replace(partial, path)  # a reader never sees half a trace
        meta = {"host": platform.node(), "pid": os.getpid(), **gpu_identity()}
        (self._dir / f"{self._name}{META_SUFFIX}").write_text(json.dumps(meta))
        logger.info("profile written: %s", path)
        return path
