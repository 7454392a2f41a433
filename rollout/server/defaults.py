"""Default limits of the embedded server (a light module: the CLI reads it without importing aiohttp or torch)."""

DEFAULT_PORT = 30000  # SGLang's
DEFAULT_MAX_BODY_BYTES = 16 * 1024**2
DEFAULT_MAX_WEIGHT_BODY_BYTES = 4 * 1024**3
DEFAULT_MAX_PROMPT_TOKENS = 32768
DEFAULT_MAX_CACHE_TOKENS = 65536
DEFAULT_BLOCK_SIZE = 16  # tokens per KV-cache block of the embedded engine
DEFAULT_MAX_RUNNING_REQUESTS = 256  # requests the embedded engine decodes at once
