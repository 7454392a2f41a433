"""The server's state, one per aiohttp application: what every route module's handlers read."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class ServerState:
    """What every handler needs: the engine, the tokenizer, the limits and the lifecycle state."""

    engine: Any  # rollout.engine.async_engine.AsyncEngine
    tokenizer: Any
    api_key: str | None
    max_body_bytes: int
    max_weight_body_bytes: int
    max_prompt_tokens: int | None
    model_path: str | None
    served_model_name: str
    body_timeout_s: float = 60.0  # a request body must arrive within this (bodies.read_json)
    weight_dirs: tuple[str, ...] = ()  # real paths /update_weights_from_disk may load from
    loopback_only: bool = False  # keyless on loopback: Host must be localhost or an IP (app._loopback_host)
    vocab_size: int | None = None
    status: str = "starting"  # starting | ready | stopping
    started_at: float = field(default_factory=time.time)
    # The last cuda_ipc entry and its parsed table: a trainer sends the same table every update (app._parse_cuda_ipc).
    last_cuda_ipc: tuple[Any, Any] | None = None

    def check_ready(self) -> None:
        if self.status != "ready":
            raise web.HTTPServiceUnavailable(
                text=json.dumps({"error": {"message": f"server is {self.status}"}}), content_type="application/json"
            )


STATE = web.AppKey("state", ServerState)


def state_of(request: web.Request) -> ServerState:
    return request.app[STATE]
