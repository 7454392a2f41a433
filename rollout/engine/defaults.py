"""Default sizes of the embedded engine (a light module: the CLI and the orchestrator read it without torch)."""

DEFAULT_BLOCK_SIZE = 16  # tokens per KV-cache block
DEFAULT_MAX_RUNNING_REQUESTS = 256  # requests decoded at once
DEFAULT_MAX_CACHE_TOKENS = 65536  # KV-cache rows, when whoever starts the engine does not size it
INDEX_KEY_CACHE_DTYPES = ("auto", "fp8_e4m3")  # the DSA indexer keys' cache (SGLang's names for kv_cache_dtype)
