"""What makes megatron-core run on a CPU with gloo: a few patches, applied only when no GPU is present.

megatron-core assumes CUDA in places that do not compute anything device-specific: buffers allocated on
`torch.cuda.current_device()`, stream bookkeeping around collectives, and the CUDA RNG tracker's seeding. On a CUDA
torch wheel without a driver every one of those raises; with these patches they run on the CPU. Nothing here changes
what a GPU run does: `apply()` returns at once when CUDA is available.
"""

from __future__ import annotations

import contextlib
import logging

import torch

logger = logging.getLogger(__name__)
_applied = False


class _NullStream:
    """Stands in for a CUDA stream: CPU ops run in program order, so there is nothing to wait for."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


def apply() -> bool:
    """Patch torch.cuda and megatron-core for a GPU-less process (idempotent). Returns whether it patched."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    # Router buffers, DDP grad buffers and TP layers allocate with device=torch.cuda.current_device().
    torch.cuda.current_device = lambda: "cpu"
    # DDP's grad sync waits on the current stream for CUDA-graph events before reducing.
    torch.cuda.current_stream = lambda device=None: _NullStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    _applied = True
    logger.info("megatron-core CPU shim applied (no CUDA device)")
    return True
