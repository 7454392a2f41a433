"""Where a CUDA process waits for the GPU: every synchronizing call, by the project code that made it.

`SyncSites` turns on torch's sync debug mode ("warn") and records each warning's Python stack: its site is the
innermost frames under slime_dsa/, rollout/ or trainers/, and, given engine step windows (rollout_call_host_time.py's),
whether it fell in a decode-only step, another step (a prefill or a mixed step) or between steps. The warnings cost time, so
a run under it measures counts, not speed. On CUDA it makes one sync of its own at the start (`probe_seen`), so that
a count of 0 can be told from a debug mode that recorded nothing.
"""

from __future__ import annotations

import collections
import threading
import time
import traceback
import warnings
from pathlib import Path

import torch

SYNC_MESSAGE = "called a synchronizing CUDA operation"
PROJECT_DIRS = ("slime_dsa", "rollout", "trainers")


def project_site(stack: list[traceback.FrameSummary], depth: int = 2) -> str:
    """The innermost `depth` frames of `stack` inside the project, innermost first: 'dir/file.py:line func <- ...'."""
    frames = [f for f in stack if any(f"/{d}/" in f.filename for d in PROJECT_DIRS)]
    if not frames:  # the innermost caller outside the warnings machinery
        frames = [f for f in stack if not f.filename.endswith("warnings.py")][-1:]
    parts = []
    for frame in reversed(frames[-depth:]):
        path = Path(frame.filename)
        parts.append(f"{path.parent.name}/{path.name}:{frame.lineno} {frame.name}")
    return " <- ".join(parts)


def step_kind(at_ns: int, windows: list[tuple[int, int, bool]]) -> str:
    """'decode' or 'other' for a time inside a step window (start ns, end ns, decode-only), else 'between'."""
    for start, end, decode_only in windows:
        if start <= at_ns <= end:
            return "decode" if decode_only else "other"
    return "between"


class SyncSites:
    """Context manager: records (time ns, thread name, site) of every synchronizing CUDA call in any thread."""

    def __init__(self, depth: int = 2) -> None:
        self.depth = depth
        self.records: list[tuple[int, str, str]] = []
        self._lock = threading.Lock()
        self._show = None
        self._filters = None
        self.probe_seen: bool | None = None  # on CUDA: whether a known sync (.item()) was recorded at the start

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if SYNC_MESSAGE not in str(message):
            self._show(message, category, filename, lineno, file, line)
            return
        site = project_site(traceback.extract_stack()[:-1], self.depth)
        with self._lock:
            self.records.append((time.time_ns(), threading.current_thread().name, site))

    def __enter__(self) -> SyncSites:
        self._filters = warnings.filters[:]
        warnings.filterwarnings("always", message=f".*{SYNC_MESSAGE}.*")  # one record per call, not per site
        self._show, warnings.showwarning = warnings.showwarning, self._record
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
            # A sync of our own, left out of the records: a summary of 0 syncs means something only if this was seen.
            torch.ones(1, device="cuda").item()
            self.probe_seen, self.records = bool(self.records), []
        return self

    def __exit__(self, *exc: object) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._show
        warnings.filters[:] = self._filters

    def summary(self, windows: list[tuple[int, int, bool]] | None = None, top: int = 15) -> dict:
        """Counts: in all, per step kind (with windows), and the `top` sites with their counts per step kind."""
        kinds = [step_kind(at, windows) if windows is not None else "-" for at, _, _ in self.records]
        per_site: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for (_, _, site), kind in zip(self.records, kinds):
            per_site[site][kind] += 1
        sites = sorted(per_site.items(), key=lambda item: -sum(item[1].values()))[:top]
        steps = collections.Counter(decode for _, _, decode in windows or [])
        return {"syncs": len(self.records), "probe_seen": self.probe_seen,
                "by_step_kind": dict(collections.Counter(kinds)),
                "steps": {"decode": steps[True], "other": steps[False]},
                "sites": [{"site": site, **counts} for site, counts in sites]}
