"""Default limits of the embedded server's HTTP front (a light module: the CLI reads it without aiohttp or torch).

The engine's own sizes (cache, running requests) are in rollout/engine/defaults.py.
"""

DEFAULT_PORT = 30000  # SGLang's
DEFAULT_MAX_BODY_BYTES = 16 * 1024**2
DEFAULT_MAX_WEIGHT_BODY_BYTES = 4 * 1024**3
DEFAULT_MAX_PROMPT_TOKENS = 32768
