"""The embedded continuous-batching engine over slime_dsa.models (CPU or GPU).

engine.py        Engine: synchronous scheduler (admission, chunked prefill, one packed forward per step)
async_engine.py  AsyncEngine: the step loop in a background thread, an asyncio API for the HTTP server
decode.py        PagedDecoder: decode-only steps reading the paged pool in place, CUDA graphs on GPU
kv_cache.py      PagedKVCache: per-layer MLA latent rows + indexer keys, the model's KVCache protocol
blocks.py        BlockManager: block allocation under a token budget, prefix cache of full blocks
sampling.py      batched sampling (temperature, top-k, top-p, min-p, seeds) and its log-probs
stop.py          stop rules (length, stop tokens, stop strings) and SGLang's text trimming
types.py         GenerateRequest / SamplingParams / GenerateOutput: the typed boundary
"""

from rollout.engine.async_engine import AsyncEngine, EngineStoppedError
from rollout.engine.engine import Engine
from rollout.engine.types import GenerateOutput, GenerateRequest, RequestError, SamplingParams

__all__ = ["AsyncEngine", "Engine", "EngineStoppedError", "GenerateOutput", "GenerateRequest", "RequestError", "SamplingParams"]
