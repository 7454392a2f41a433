"""The GPU-busy share of a benchmark's timed steps, from NVML (device-wide, so work in other processes such as Ray
actors counts), two ways:

- polled: a thread reads the utilisation every ~20 ms. Each reading is NVML's percent of its own trailing sample
  period (1/6 s to 1 s, by product) in which a kernel ran, so readings overlap and lag: a mean over whole steps of a
  second or more is what it measures well.
- driver: the driver's own utilisation samples (`nvmlDeviceGetSamples`, slime_dsa/gpu_utilization.py), each
  stamped with the time it was taken, read in batches every ~0.1 s; a step's share is the mean of the samples stamped
  inside it, so short steps are not smeared into their neighbours. Only where the driver keeps such samples and
  stamps them on the wall clock.

Each step's share is the mean of the readings taken during it. pynvml comes from the `nvidia-ml-py` package and is
optional: without it, or without a GPU, there is no source and the report says "-".
"""

from __future__ import annotations

import logging
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slime_dsa.gpu_utilization import Reading, driver_samples, nvml_device  # noqa: E402

logger = logging.getLogger(__name__)

Source = Callable[[], list[Reading]]  # the readings taken since its last call
READ_EVERY_S = {"polled": 0.02, "driver": 0.1}  # the driver's buffer holds seconds of samples: batches suffice


def nvml_sources() -> dict[str, Source]:
    """NVML's views of this process's first visible GPU: "polled" and, where the driver keeps stamped samples,
    "driver" (the module docstring says how they differ); {} without pynvml, a driver or a GPU."""
    device = nvml_device(0)
    if device is None:
        return {}
    pynvml, handle = device
    sources: dict[str, Source] = {
        "polled": lambda: [(time.perf_counter(), float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))]}
    driver = driver_samples(pynvml, handle)
    if driver is not None:
        sources["driver"] = driver
    return sources


class UtilizationSampler:
    """Reads `source` every `interval_s` in a daemon thread while running, and once more as it stops (the driver's
    last batch); `samples` holds (perf_counter, percent)."""

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
        while True:
            stopping = self._stop.is_set()
            try:
                self.samples.extend(self.source())
            except Exception as e:  # noqa: BLE001 (a failed reading ends the sampling, never the benchmark)
                logger.warning("GPU utilisation reading failed, sampling stops: %s", e)
                return
            if stopping:
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


@contextmanager
def sampling(sources: dict[str, Source]) -> Iterator[dict[str, UtilizationSampler]]:
    """A running UtilizationSampler of each source, by name, for the duration of the block."""
    with ExitStack() as stack:
        yield {name: stack.enter_context(UtilizationSampler(source, READ_EVERY_S.get(name, 0.02)))
               for name, source in sources.items()}


def busy_figures(samplers: dict[str, UtilizationSampler], steps: Sequence[Window]) -> dict[str, Any]:
    """gpu_busy / gpu_busy_steps (polled: the mean over steps 2..N, and per step) and gpu_busy_driver /
    gpu_busy_driver_steps (the driver's samples): None and [] where not measured."""
    out: dict[str, Any] = {}
    for name, key in (("polled", "gpu_busy"), ("driver", "gpu_busy_driver")):
        sampler = samplers.get(name)
        out[key] = busy_after_first(sampler.samples, steps) if sampler else None
        out[f"{key}_steps"] = step_busy(sampler.samples, steps) if sampler else []
    return out


def busy_cell(value: float | None) -> str:
    """A percent for the report, or '-' when not measured."""
    return "-" if value is None else f"{value:.0f}%"
