"""The embedded continuous-batching engine over slime_dsa.models (CPU or GPU).

engine.py        Engine: the scheduler (admission, chunked prefill, one packed forward per step, overlap of steps)
async_engine.py  AsyncEngine: the step loop in a background thread, an asyncio API for the HTTP server
decode.py        PagedDecoder: decode-only steps reading the paged pool in place, CUDA graphs on GPU
kv_cache.py      PagedKVCache: per-layer MLA latent rows + indexer keys, the model's KVCache protocol
blocks.py        BlockManager: block allocation under a token budget, prefix cache of full blocks
sampling.py      batched sampling (temperature, top-k, top-p, min-p, seeded draws) and its log-probs
rows.py          SamplingRows: a step's sampling parameters, seeds, limits and stop tokens kept on the device
stop.py          stop rules (length, stop tokens, stop strings) and SGLang's text trimming
types.py         GenerateRequest / SamplingParams / GenerateOutput: the typed boundary
defaults.py      default sizes (block, running requests, cache), readable without torch

Exports load lazily, so that reading defaults.py (the CLI, the orchestrator's sizing) imports no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AsyncEngine": "rollout.engine.async_engine", "EngineStoppedError": "rollout.engine.async_engine",
    "Engine": "rollout.engine.engine", "GenerateOutput": "rollout.engine.types",
    "GenerateRequest": "rollout.engine.types", "RequestError": "rollout.engine.types",
    "SamplingParams": "rollout.engine.types",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rollout.engine' has no attribute {name!r}")
