"""Default sizes of the embedded engine (a light module: the CLI and the orchestrator read it without torch)."""

DEFAULT_BLOCK_SIZE = 16  # tokens per KV-cache block
# Decode steps a launch of an RL run's embedded engines (rollout.num_continuous_decode_steps null): at 64 x 16 on an
# H100 it took the decode steps' host gap from ~37% to ~10% (benchmarks/RESULTS.md, 2026-12-07).
RL_CONTINUOUS_DECODE_STEPS = 4
DEFAULT_MAX_RUNNING_REQUESTS = 256  # requests decoded at once
DEFAULT_MAX_CACHE_TOKENS = 65536  # KV-cache rows, when whoever starts the engine does not size it
INDEX_KEY_CACHE_DTYPES = ("auto", "fp8_e4m3")  # the DSA indexer keys' cache (SGLang's names for kv_cache_dtype)
