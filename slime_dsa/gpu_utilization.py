"""How busy a GPU was, from the NVML driver's own utilisation samples (`nvmlDeviceGetSamples`): each is the percent
of the driver's sample period (1/6 s to 1 s, by product) in which a kernel ran, stamped with the time it was taken,
so a window's share is the mean of the samples stamped inside it. Device-wide: every process on the GPU counts (a
colocated engine's too). pynvml (the `nvidia-ml-py` package) is optional: without it, a driver or a GPU there is
nothing to read, and callers report nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

Reading = tuple[float, float]  # (time.perf_counter seconds, percent busy)
MAX_SAMPLE_AGE_S = 86_400.0  # a newest sample older than a day: the driver stamps off the wall clock


def nvml_device(index: int = 0) -> tuple[Any, Any] | None:
    """(pynvml, handle) of this process's visible GPU `index` (CUDA_VISIBLE_DEVICES mapped to NVML's numbering), or
    None without pynvml, a driver or that GPU."""
    try:
        import pynvml
    except ImportError:
        logger.info("GPU utilisation not measured: pynvml (pip install nvidia-ml-py) is not installed")
        return None
    try:
        pynvml.nvmlInit()
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        name = visible[index] if index < len(visible) else str(index)
        if name.startswith(("GPU-", "MIG-")):
            handle = pynvml.nvmlDeviceGetHandleByUUID(name)
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(name) if name.isdigit() else index)
        pynvml.nvmlDeviceGetUtilizationRates(handle)
    except (pynvml.NVMLError, ValueError) as e:
        logger.info("GPU utilisation not measured: NVML: %s", e)
        return None
    return pynvml, handle


def driver_samples(pynvml: Any, handle: Any) -> Callable[[], list[Reading]] | None:
    """A reader of the driver's utilisation samples newer than its last call's (the first call: newer than now), on
    the perf_counter clock; None where the driver keeps none or stamps them off the wall clock."""
    def fetch(after_us: int) -> list[Any]:
        try:
            return pynvml.nvmlDeviceGetSamples(handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, after_us)[1]
        except pynvml.NVMLError as e:
            if e.value == pynvml.NVML_ERROR_NOT_FOUND:  # no sample newer than after_us
                return []
            raise

    try:
        first = fetch(0)
    except pynvml.NVMLError as e:
        logger.info("GPU utilisation from the driver's samples not measured: NVML: %s", e)
        return None
    wall_to_perf = time.perf_counter() - time.time()
    # With an empty buffer, samples stamped before now are skipped (and, stamped off the wall clock, never come).
    last_us = max((s.timeStamp for s in first), default=int(time.time() * 1e6))
    age_s = time.time() - last_us / 1e6
    if not -1.0 <= age_s <= MAX_SAMPLE_AGE_S:
        logger.info("GPU utilisation from the driver's samples not measured: its newest sample is stamped %.1f s "
                    "from now", age_s)
        return None

    def read() -> list[Reading]:
        nonlocal last_us
        samples = fetch(last_us)
        if samples:
            last_us = max(s.timeStamp for s in samples)
        return [(s.timeStamp / 1e6 + wall_to_perf, float(s.sampleValue.uiVal)) for s in samples]

    return read


class GpuBusyMeter:
    """The busy share (0-1) of one GPU between successive `take` calls, from the driver's samples. A daemon thread
    reads them every `poll_s` (None: only at `take`), since the driver keeps a bounded buffer of them: a window longer
    than that would otherwise count only its end."""

    def __init__(self, read: Callable[[], list[Reading]], poll_s: float | None = 1.0) -> None:
        self._read = read
        self._lock = threading.Lock()
        self._sum, self._count = 0.0, 0
        self._failed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if poll_s is not None:
            self._thread = threading.Thread(target=self._poll, args=(poll_s,), name="gpu-busy-meter", daemon=True)
            self._thread.start()

    @classmethod
    def open(cls, index: int = 0, poll_s: float | None = 1.0) -> GpuBusyMeter | None:
        """A meter of visible GPU `index`, or None where NVML or the driver's samples are not there."""
        device = nvml_device(index)
        read = driver_samples(*device) if device is not None else None
        return cls(read, poll_s) if read is not None else None

    def take(self) -> float | None:
        """The mean of the samples taken since the last call, or None without any (or once a read has failed)."""
        self._collect()
        with self._lock:
            share = self._sum / self._count / 100.0 if self._count else None
            self._sum, self._count = 0.0, 0
        return share

    def close(self) -> None:
        """Stop the polling thread (and wait for it: a read in progress ends first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)

    def _collect(self) -> None:
        with self._lock:
            if self._failed:
                return
            try:
                samples = self._read()
            except Exception as e:  # noqa: BLE001 (a metric's failure never fails the step)
                logger.warning("GPU utilisation reading failed, no GPU busy share from here on: %s", e)
                self._failed, self._sum, self._count = True, 0.0, 0
                return
            self._sum += sum(u for _, u in samples)
            self._count += len(samples)

    def _poll(self, every_s: float) -> None:
        while not self._stop.wait(every_s) and not self._failed:
            self._collect()
