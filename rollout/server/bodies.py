"""Request bodies: JSON read under a byte limit; every failure is a RequestError (HTTP 400) that says why."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from rollout.engine.types import RequestError
from rollout.server.state import state_of


async def read_json(request: web.Request, limit: int) -> Any:
    """The JSON body, read up to `limit` bytes; RequestError (400) past the limit or when it is not JSON."""
    if request.content_length is not None and request.content_length > limit:
        raise RequestError(f"request body is {request.content_length} bytes; the limit is {limit} (max_body_bytes)")
    chunks, size = [], 0
    async for chunk in request.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > limit:
            raise RequestError(f"request body exceeds the limit of {limit} bytes (max_body_bytes)")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"request body is not valid JSON: {e}") from None


async def read_object(request: web.Request, limit: int | None = None) -> dict:
    """A JSON object body (GET requests and empty bodies give {})."""
    if request.method == "GET":
        return dict(request.query)
    body = await read_json(request, limit or state_of(request).max_body_bytes)
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body
