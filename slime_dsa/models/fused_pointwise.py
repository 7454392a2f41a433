"""A decoder layer's small pointwise chains (RMSNorm, the interleaved RoPE, the router's scoring and selection, the
gated MLP's activation) run through torch.compile, each as one or two fused kernels: an engine's decode steps
(Engine(enable_torch_compile=True), SGLang's --enable-torch-compile), inside their CUDA graphs.

Eagerly each chain is 2-12 kernels of a few microseconds. At RL batch sizes a decode step of the one-GPU recipes'
model is ~750 such kernels, and inside its CUDA graph the gaps between them are much of the step. Compiled with
emulate_precision_casts, each chain keeps eager's roundings to the model's dtype between its ops. Only decode steps
switch them on (`fusing`): replayed from a graph they cost no host time, while an eager prefill step would pay
dynamo's guard checks at every call.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator

import torch
from torch import nn

# Compiled variants a chain may have (layer widths, contiguous or not, a batch of one): dynamo's default of 8 a code
# object would leave the rest eager, with a log line only.
COMPILED_VARIANTS = 64
_compiled: dict[tuple, Callable] = {}
_switch = threading.local()  # per thread: engines of one process step on threads of their own


def allow_compiled_variants(limit: int = COMPILED_VARIANTS) -> None:
    """Raise dynamo's recompile limit (a process-wide setting) to at least `limit` variants a code object."""
    name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))


def enable(model: nn.Module) -> None:
    """Let `model`'s modules run their chains compiled inside `fusing` (their `fused_pointwise` flag: a trainer's
    modules keep it off, so a compiled trainer layer never traces the switch)."""
    allow_compiled_variants()
    for module in model.modules():
        if hasattr(module, "fused_pointwise"):
            module.fused_pointwise = True


@contextlib.contextmanager
def fusing(on: bool = True) -> Iterator[None]:
    """Within this block, on this thread, enabled modules run their chains compiled (an engine's decode forward)."""
    before = active()
    _switch.on = on
    try:
        yield
    finally:
        _switch.on = before


def active() -> bool:
    return getattr(_switch, "on", False)


def run(fn: Callable, *tensors: torch.Tensor, **constants):
    """fn(*tensors, **constants) through torch.compile: one compiled callable a (fn, constants), shapes dynamic, the
    constants fixed in its graphs."""
    key = (fn, *constants.items())
    compiled = _compiled.get(key)
    if compiled is None:
        compiled = _compiled[key] = torch.compile(functools.partial(fn, **constants), dynamic=True,
                                                  options={"emulate_precision_casts": True})
    return compiled(*tensors)
