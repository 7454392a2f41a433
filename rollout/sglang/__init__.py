"""Real SGLang servers: launch config and command line, subprocess launcher, external mode (weight sync with them:
slime_dsa.weights.payloads and slime_dsa.orchestrator.weight_sync)."""

from rollout.sglang.config import SGLangConfig, SpeculativeConfig, build_command
from rollout.sglang.external import external_urls, register_with_router
from rollout.sglang.launcher import SGLangLaunchError, SGLangServer

__all__ = [
    "SGLangConfig", "SpeculativeConfig", "build_command", "SGLangServer", "SGLangLaunchError", "external_urls",
    "register_with_router",
]
