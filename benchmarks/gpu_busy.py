"""The GPU-busy share of a benchmark's timed steps: a thread reads the device's utilisation (NVML, device-wide, so
work in other processes such as Ray actors counts) every ~20 ms; each step's share is the mean of the readings
taken during it.

NVML's utilisation is the percent of its own sample period (1/6 s to 1 s, by product) in which a kernel ran, so
readings 20 ms apart overlap: a mean over whole steps of a second or more is what it measures well. pynvml comes from
the `nvidia-ml-py` package and is optional: without it, or without a GPU, there is no source and the report says
"-".
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)

Source = Callable[[], float]  # the device's utilisation now, in percent


def nvml_source() -> Source | None:
    """The utilisation of this process's first visible GPU through NVML, or None (no pynvml, no driver, no GPU)."""
    try:
        import pynvml
    except ImportError:
        logger.info("GPU busy share not measured: pynvml (pip install nvidia-ml-py) is not installed")
        return None
    try:
        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        if visible.startswith(("GPU-", "MIG-")):
            handle = pynvml.nvmlDeviceGetHandleByUUID(visible)
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else 0)
        pynvml.nvmlDeviceGetUtilizationRates(handle)
    except pynvml.NVMLError as e:
        logger.info("GPU busy share not measured: NVML: %s", e)
        return None
    return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)


class UtilizationSampler:
    """Reads `source` every `interval_s` in a daemon thread while running; `samples` holds (perf_counter, percent)."""

    def __init__(self, source: Source, interval_s: float = 0.02) -> None:
        self.source, self.interval_s = source, interval_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> UtilizationSampler:
        self._thread = threading.Thread(target=self._run, name="gpu-busy", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.perf_counter(), self.source()))
            except Exception as e:  # noqa: BLE001 (a failed reading ends the sampling, never the benchmark)
                logger.warning("GPU utilisation reading failed, sampling stops: %s", e)
                return
            self._stop.wait(self.interval_s)


Window = tuple[float, float]  # one step's [start, end) on the perf_counter clock


def windows(stamps: Sequence[float], excluded: Sequence[float] = ()) -> list[Window]:
    """Each step's window from consecutive stamps (the first is the loop's start); `excluded[i]` seconds at the end of
    step i are left out (work the step clock does not count)."""
    cut = list(excluded) + [0.0] * (len(stamps) - 1 - len(excluded))
    return [(start, end - c) for start, end, c in zip(stamps, stamps[1:], cut)]


def step_busy(samples: Sequence[tuple[float, float]], steps: Sequence[Window]) -> list[float | None]:
    """Mean utilisation (percent) of the readings in each step's window; None where a step has none."""
    out: list[float | None] = []
    for start, end in steps:
        inside = [u for t, u in samples if start <= t < end]
        out.append(statistics.mean(inside) if inside else None)
    return out


def busy_after_first(samples: Sequence[tuple[float, float]], steps: Sequence[Window]) -> float | None:
    """Mean utilisation over the readings of steps 2..N (step 1 warms up; step 1 itself when it is the only one);
    None without readings."""
    later = steps[1:] or steps
    inside = [u for t, u in samples if any(start <= t < end for start, end in later)]
    return statistics.mean(inside) if inside else None


def busy_cell(value: float | None) -> str:
    """A percent for the report, or '-' when not measured."""
    return "-" if value is None else f"{value:.0f}%"
