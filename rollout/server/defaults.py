"""Default limits of the embedded server's HTTP front (a light module: the CLI reads it without aiohttp or torch).

The engine's own sizes (cache, running requests) are in rollout/engine/defaults.py.
"""

DEFAULT_PORT = 30000  # SGLang's
API_KEY_ENV = "SLIME_DSA_API_KEY"  # the key `serve` requires and `generate` sends when --api-key is not given
DEFAULT_MAX_BODY_BYTES = 16 * 1024**2
DEFAULT_MAX_WEIGHT_BODY_BYTES = 4 * 1024**3
DEFAULT_MAX_PROMPT_TOKENS = 32768
DEFAULT_BODY_TIMEOUT_S = 60.0  # a request body must arrive within this (a client that stalls mid-body gets 408)
DEFAULT_WEIGHT_BODY_TIMEOUT_S = 600.0  # weight updates: up to DEFAULT_MAX_WEIGHT_BODY_BYTES over a slow link
