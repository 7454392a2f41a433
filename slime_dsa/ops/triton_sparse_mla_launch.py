"""What the sparse MLA kernels share (triton_sparse_mla.py and its variant modules): launch configs, the choice of a
config per problem shape, and the scan for a row's last used index slot."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
SCAN_SLOTS = 1024  # index slots per step of the scan for a row's last used slot


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape of one kernel: heads per program, keys per step, warps, pipeline stages."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int


# The config (or mode) each kernel kind keeps per problem shape, once one has worked.
_chosen: dict[tuple, KernelConfig | str] = {}


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def _scan_block(K: int) -> int:
    return min(SCAN_SLOTS, _pow2(K))


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's interpreter (TRITON_INTERPRET=1) runs on CPU tensors
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


LAUNCH_FAILURES = (triton.runtime.errors.OutOfResources, triton.CompilationError, RuntimeError)


def _launch(kind: str, key: tuple, configs: list[KernelConfig], launch,
            failures: tuple[type[BaseException], ...] = LAUNCH_FAILURES) -> None:
    """Run `launch(cfg)` with the remembered config for `key`, or find the first config that works: one that raises
    one of `failures` moves on to the next, any other error propagates."""
    cached = _chosen.get((kind, key))
    if cached is not None:
        launch(cached)
        return
    errors = []
    for cfg in configs:
        try:
            launch(cfg)
        except failures as err:
            errors.append(f"{cfg}: {type(err).__name__}: {str(err)[:200]}")
            continue
        _chosen[(kind, key)] = cfg
        return
    raise RuntimeError(f"no {kind} kernel config fits this device:\n" + "\n".join(errors))


def _launch_first_fitting(kind: str, key: tuple, configs: list[KernelConfig], launch) -> None:
    """Like `_launch`, but only a config that does not compile or fit moves on to the next (a deterministic
    function of the device model and the problem shape); any other error propagates."""
    _launch(kind, key, configs, launch, (triton.runtime.errors.OutOfResources, triton.CompilationError))


def _launch_fastest(kind: str, key: tuple, configs: list[KernelConfig], launch, device: torch.device) -> None:
    """Like `_launch`, but the first call for `key` times every config that fits and keeps the fastest.

    Only for launches that overwrite their outputs (no accumulation), since each config runs several times.
    Timing: two launches between CUDA events after a warm-up one. On the interpreter (CPU), the first that works.
    """
    if (kind, key) in _chosen or device.type != "cuda":
        _launch(kind, key, configs, launch)
        return
    timings, errors = [], []
    for cfg in configs:
        try:
            launch(cfg)  # compiles; also the warm-up
        except (triton.runtime.errors.OutOfResources, triton.CompilationError, RuntimeError) as err:
            errors.append(f"{cfg}: {type(err).__name__}: {str(err)[:200]}")
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch(cfg)
        launch(cfg)
        end.record()
        end.synchronize()
        timings.append((start.elapsed_time(end), configs.index(cfg)))
    if not timings:
        raise RuntimeError(f"no {kind} kernel config fits this device:\n" + "\n".join(errors))
    best = configs[min(timings)[1]]
    _chosen[(kind, key)] = best
    launch(best)  # the outputs of the kept config, as every later call computes them


@triton.jit
def _used_slots_end(idx_row_ptr, lo, hi, SCAN: tl.constexpr):
    """One past the last slot of lo..hi-1 that holds a key (-1 = unused), lo if none: key loops stop there."""
    end = lo
    for c0 in range(lo, hi, SCAN):
        offs = c0 + tl.arange(0, SCAN)
        idx = tl.load(idx_row_ptr + offs, mask=offs < hi, other=-1)
        end = tl.maximum(end, tl.max(tl.where(idx >= 0, offs + 1, 0), axis=0))
    return end
