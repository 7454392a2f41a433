"""Request bodies: JSON read under a byte limit and a deadline; every failure is a RequestError that says why (HTTP
400; 413 past the limit; 408 when the body does not arrive in time)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from aiohttp import web

from rollout.engine.types import RequestError
from rollout.server.state import state_of

class BodyTooLargeError(RequestError):
    """The body is over the route's byte limit (HTTP 413)."""

    status = 413


class ClientGoneError(RequestError):
    """The client closed the connection before its body arrived: logged as a request error, not a server fault (the
    reply cannot reach it)."""


class BodyTimeoutError(RequestError):
    """The body did not arrive before the deadline: a client that sends part of it and stalls (HTTP 408)."""

    status = 408


async def read_json(request: web.Request, limit: int, timeout_s: float | None = None) -> Any:
    """The JSON body, read up to `limit` bytes within `timeout_s` (default: the server's body_timeout_s)."""
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLargeError(f"request body is {request.content_length} bytes; the limit is {limit} (max_body_bytes)")
    timeout_s = timeout_s or state_of(request).body_timeout_s
    try:
        raw = await asyncio.wait_for(_read(request, limit), timeout_s)
    except asyncio.TimeoutError:
        raise BodyTimeoutError(f"request body not received within {timeout_s:g} s (body_timeout_s)") from None
    except ConnectionResetError:
        raise ClientGoneError("the client closed the connection before its request body arrived") from None
    if not raw.strip():
        return {}
    return parse_json(raw)


async def _read(request: web.Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > limit:
            raise BodyTooLargeError(f"request body exceeds the limit of {limit} bytes (max_body_bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes) -> Any:
    """json.loads with every failure a RequestError: invalid JSON or UTF-8, nesting too deep, lone surrogates."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise RequestError("request body nests too deeply") from None
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(body):
        raise RequestError("request body holds a lone UTF-16 surrogate (\\ud800-\\udfff) in a string")
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # only an escape can put a surrogate into the parsed strings


def _has_lone_surrogate(value: Any) -> bool:
    """Whether a string holds a surrogate that no pair completed: it cannot be encoded as UTF-8 (a tokeniser or
    a reply would fail on it later)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


async def read_object(request: web.Request, limit: int | None = None, timeout_s: float | None = None) -> dict:
    """A JSON object body (GET requests and empty bodies give {})."""
    if request.method == "GET":
        return dict(request.query)
    body = await read_json(request, limit or state_of(request).max_body_bytes, timeout_s)
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body
