"""HTTP server speaking SGLang's native protocol (and OpenAI's) in front of the embedded engine; InProcessClient
answers the same /generate in this process, without HTTP.

Exports load lazily, so that `slime-dsa --help` (which imports rollout.server.command) stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "create_app": "rollout.server.app", "serve": "rollout.server.launch", "load_engine": "rollout.server.launch",
    "EmbeddedServer": "rollout.server.launch", "InProcessClient": "rollout.server.in_process",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rollout.server' has no attribute {name!r}")
