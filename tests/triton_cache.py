"""Compiled variants of the project's Triton kernels, for GPU tests that check a warm-up left nothing to compile."""

from __future__ import annotations

import importlib
import pkgutil


def compiled_kernels() -> dict[str, int]:
    """Compiled variants of each Triton kernel of slime_dsa.ops, by name (Triton's in-memory cache, all devices)."""
    import slime_dsa.ops  # noqa: PLC0415
    from triton.runtime.jit import JITFunction  # noqa: PLC0415

    counts = {}
    for info in pkgutil.iter_modules(slime_dsa.ops.__path__):
        if info.name.startswith("triton"):
            module = importlib.import_module(f"slime_dsa.ops.{info.name}")
            for name, fn in vars(module).items():
                if isinstance(fn, JITFunction):
                    counts[f"{info.name}.{name}"] = sum(len(cache[0]) for cache in fn.device_caches.values())
    return counts


def new_compiles(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Kernels with variants compiled between two compiled_kernels() readings, and how many."""
    return {name: n - before.get(name, 0) for name, n in after.items() if n != before.get(name, 0)}
