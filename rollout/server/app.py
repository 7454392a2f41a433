"""The HTTP server: SGLang's native API (plus the OpenAI-compatible routes) in front of one AsyncEngine.

aiohttp serves and (in rollout.client) requests: one well-kept library for both ends, with SSE streaming,
handler cancellation on client disconnect (which aborts the engine request), and a client connection pool
that holds thousands of concurrent requests.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import ipaddress
import json
import logging
import os
import time
from typing import Any, Sequence

from aiohttp import web

from rollout.engine.async_engine import EngineStoppedError
from rollout.engine.engine import PAUSE_MODES
from rollout.engine.types import GenerateRequest, RequestError, SamplingParams
from rollout.server import openai_api, profiling, protocol
from rollout.server.bodies import read_json, read_object
from rollout.server.defaults import (
    DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_MAX_WEIGHT_BODY_BYTES,
    DEFAULT_WEIGHT_BODY_TIMEOUT_S,
)
from rollout.server.run import run_all, run_request
from rollout.server.state import STATE, ServerState, state_of
from slime_dsa.weights import WeightFormatError
from slime_dsa.weights.cuda_ipc import LOAD_FORMAT_CUDA_IPC
from slime_dsa.weights.safetensors_b64 import LOAD_FORMAT, PICKLE_REFUSAL, SGLANG_PICKLE_FORMATS, decode_named_tensors

logger = logging.getLogger(__name__)

UNSUPPORTED_DISTRIBUTED = (
    "{path} is not supported by the embedded engine: it joins no NCCL group. Send weights with "
    f"/update_weights_from_tensor (load_format {LOAD_FORMAT!r}) or /update_weights_from_disk"
)
PUBLIC_PATHS = frozenset({"/health", "/health_generate"})
JSON_TYPES = ("application/json",)  # and any application/*+json
OUTSIDE_WEIGHT_DIRS = ("model_path is not in a directory this server may load weights from (start it with --weight-dir "
                       "DIR)")  # the same words whether the path exists or not: the reply must not reveal it


def error_response(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """RequestError -> 400 naming the field; an unexpected error costs its request a 500, never the server."""
    try:
        return await handler(request)
    except RequestError as e:  # 400, or the status its class says (413 too large, 408 body too slow)
        status = getattr(e, "status", 400)
        logger.info("%d %s %s: %s", status, request.method, request.path, e)
        return error_response(str(e), status)
    except web.HTTPException as e:
        if e.content_type == "application/json" or e.status < 400:
            raise
        return error_response(e.text or e.reason, e.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except EngineStoppedError as e:
        return error_response(f"engine unavailable: {e}", 503)
    except Exception as e:
        logger.exception("500 %s %s", request.method, request.path)
        return error_response(f"internal error: {type(e).__name__}: {e}", 500)


@web.middleware
async def _auth(request: web.Request, handler) -> web.StreamResponse:
    """With an API key, every route but the health checks needs it: generation, and everything that changes state."""
    key = state_of(request).api_key
    if key and request.path not in PUBLIC_PATHS:
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return error_response("missing or wrong API key: send the header 'Authorization: Bearer <key>'", 401)
    return await handler(request)


@web.middleware
async def _loopback_host(request: web.Request, handler) -> web.StreamResponse:
    """A keyless server on a loopback address answers requests addressed to a loopback name or an IP only: a web page
    whose own domain is rebound to 127.0.0.1 (DNS rebinding) sends its requests as same-origin, with that domain in
    the Host header, so neither CORS nor the JSON-only rule stops it."""
    host = request.headers.get("Host")
    if host is not None and state_of(request).loopback_only and not _is_loopback_host(host):
        return error_response(f"Host {host!r} is not a loopback name or an IP address: this server has no API key and "
                              "listens on a loopback address, so it answers http://127.0.0.1 or http://localhost only "
                              "(give it --api-key to be reached by other names)", 403)
    return await handler(request)


def is_loopback_address(host: str) -> bool:
    """Whether a listening address (serve --host) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_loopback_host(host: str) -> bool:
    """Whether a Host header names this machine in a way no web page's domain can: an IP literal or localhost."""
    name = host[1:].split("]", 1)[0] if host.startswith("[") else host.rsplit(":", 1)[0]  # '[v6]:port', 'name:port'
    name = name.rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@web.middleware
async def _json_only(request: web.Request, handler) -> web.StreamResponse:
    """Every POST says Content-Type: application/json, even with an empty body. A web page can POST a form or text to
    127.0.0.1 without the browser asking first; for JSON the browser asks (CORS preflight), and we never allow it."""
    if request.method == "POST" and not _is_json(request.content_type):
        return error_response(f"POST {request.path} needs Content-Type: application/json, got "
                              f"{request.headers.get('Content-Type') or 'none'}", 415)
    return await handler(request)


def _is_json(content_type: str) -> bool:
    return content_type in JSON_TYPES or (content_type.startswith("application/") and content_type.endswith("+json"))


def _field(body: dict, key: str, types: tuple[type, ...], default: Any) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        names = "/".join(t.__name__ for t in types)
        raise RequestError(f"{key} must be {names}, got {value!r}")
    return value


# ---- generation -------------------------------------------------------------------------------------------

async def generate(request: web.Request) -> web.StreamResponse:
    """POST /generate: SGLang's native generation (single, batch, n samples, SSE stream)."""
    st = state_of(request)
    t0 = time.perf_counter()
    st.check_ready()
    body = await read_json(request, st.max_body_bytes)
    parse = functools.partial(protocol.parse_generate, body, tokenizer=st.tokenizer, vocab_size=st.vocab_size,
                              max_prompt_tokens=st.max_prompt_tokens)
    # Text is tokenised off the event loop (sizes are checked first), so /health and other requests go on meanwhile.
    call = await asyncio.to_thread(parse) if protocol.has_text(body) else parse()
    if call.stream:
        return await _stream(request, st, call, t0)
    outputs = await run_all(st.engine, call.requests)
    latency = time.perf_counter() - t0
    with protocol.collector_paused():  # the response lists die once serialised: no collector pass needs to see them
        results = [
            protocol.build_response(out, req, tokenizer=st.tokenizer, e2e_latency=latency,
                                    return_text_in_logprobs=call.return_text_in_logprobs)
            for out, req in zip(outputs, call.requests)
        ]
        return web.Response(body=protocol.response_json(results if call.is_batch else results[0], outputs),
                            content_type="application/json")


async def _stream(request: web.Request, st: ServerState, call: protocol.GenerateCall, t0: float) -> web.StreamResponse:
    """SSE: `data: {cumulative response}` per update (with "index" in a batch), then `data: [DONE]`."""
    gens = [st.engine.generate(r) for r in call.requests]
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for out in gens[i]:
                await queue.put((i, out, None))
        except RequestError as e:
            await queue.put((i, None, e))
        except Exception as e:
            logger.exception("stream %s failed", call.requests[i].rid)
            await queue.put((i, None, e))
        finally:
            await queue.put((i, None, StopAsyncIteration()))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(gens))]
    response = None
    try:
        # Wait for the first event before answering, so an invalid request still gets a plain 400.
        first = await queue.get()
        if isinstance(first[2], RequestError):
            raise first[2]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        done, event = 0, first
        while True:
            i, out, err = event
            if isinstance(err, StopAsyncIteration):
                done += 1
                if done == len(gens):
                    break
            elif err is not None:
                await _sse(response, {"error": {"message": f"{type(err).__name__}: {err}"}, "index": i})
            else:
                chunk = protocol.build_response(
                    out, call.requests[i], tokenizer=st.tokenizer, e2e_latency=time.perf_counter() - t0,
                    return_text_in_logprobs=call.return_text_in_logprobs,
                )
                if call.is_batch:
                    chunk["index"] = i
                await _sse(response, chunk)
            event = await queue.get()
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()


async def _sse(response: web.StreamResponse, obj: dict) -> None:
    await response.write(b"data: " + json.dumps(obj).encode() + b"\n\n")


# ---- health and info --------------------------------------------------------------------------------------

async def health(request: web.Request) -> web.Response:
    """200 while the server is ready and the engine thread runs; 503 while starting or stopping."""
    st = state_of(request)
    st.check_ready()
    if not getattr(st.engine, "running", True):
        return error_response("the engine is not running", 503)
    return web.Response(status=200)


async def health_generate(request: web.Request) -> web.Response:
    """200 when a one-token greedy generation succeeds (or the engine is deliberately paused); else 503."""
    st = state_of(request)
    st.check_ready()
    if st.engine.server_info().get("paused"):
        return web.Response(status=200)
    req = GenerateRequest(input_ids=[0], sampling=SamplingParams(max_new_tokens=1, temperature=0.0),
                          rid=f"health-{time.monotonic_ns()}")
    try:
        out = await asyncio.wait_for(run_request(st.engine, req), timeout=30)
    except Exception as e:
        logger.warning("health_generate failed: %s", e)
        return error_response(f"health generation failed: {e}", 503)
    if out.finish_reason.get("type") == "abort":
        return error_response(f"health generation aborted: {out.finish_reason.get('message')}", 503)
    return web.Response(status=200)


def model_info_dict(st: ServerState) -> dict:
    tokenizer_path = st.model_path if st.tokenizer is not None else None
    info = {"model_path": st.model_path, "tokenizer_path": tokenizer_path, "is_generation": True,
            "preferred_sampling_params": None, "served_model_name": st.served_model_name}
    info.update({k: v for k, v in st.engine.model_info().items() if v is not None})
    info["weight_version"] = str(st.engine.weight_version)
    return info


async def model_info(request: web.Request) -> web.Response:
    return web.json_response(model_info_dict(state_of(request)))


async def server_info(request: web.Request) -> web.Response:
    st = state_of(request)
    from slime_dsa import __version__

    info = {
        "model_path": st.model_path, "served_model_name": st.served_model_name, "backend": "slime-dsa embedded",
        "version": __version__, "api_key_required": bool(st.api_key), "max_body_bytes": st.max_body_bytes,
        "max_weight_body_bytes": st.max_weight_body_bytes, "max_prompt_tokens": st.max_prompt_tokens,
        "status": st.status, "uptime_s": time.time() - st.started_at,
        "num_running_reqs": st.engine.num_running, "num_waiting_reqs": st.engine.num_queued,
    }
    info.update(st.engine.server_info())
    info["weight_version"] = str(st.engine.weight_version)
    return web.json_response(info)


async def get_weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": str(state_of(request).engine.weight_version)})


# ---- control ----------------------------------------------------------------------------------------------

async def flush_cache(request: web.Request) -> web.Response:
    if await state_of(request).engine.flush_cache():
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. "
                                 "(When there are running or waiting requests, the operation will not be performed.)\n")
    return web.Response(status=400, text="Cache not flushed: requests are running or waiting. "
                                         "Pause generation (or abort the requests) first.\n")


async def abort_request(request: web.Request) -> web.Response:
    body = await read_object(request)
    rid = _field(body, "rid", (str,), "")
    abort_all = _field(body, "abort_all", (bool,), False)
    await state_of(request).engine.abort(rid=rid or None, abort_all=abort_all)
    return web.Response(status=200)


async def pause_generation(request: web.Request) -> web.Response:
    body = await read_object(request)
    mode = _pause_mode(body, "mode", "abort")
    await state_of(request).engine.pause(mode=mode)
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    await read_object(request)
    await state_of(request).engine.resume()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


def _pause_mode(body: dict, key: str, default: str | None) -> str | None:
    mode = _field(body, key, (str,), default)
    if mode is not None and mode not in PAUSE_MODES:
        raise RequestError(f"{key} must be one of 'abort', 'retract', 'in_place', got {mode!r}")
    return mode


def _update_result(ok: bool, message: str, extra: dict | None = None) -> web.Response:
    return web.json_response({"success": ok, "message": message, **(extra or {})}, status=200 if ok else 400)


def _step_stats(st: ServerState) -> dict:
    """The engine's step-loop counters, read once the update's command is counted: a successful update's reply
    carries them, so the orchestrator's per-step stats need no /get_server_info (SGLang's replies do not)."""
    step_stats = getattr(st.engine, "step_stats", None)
    return step_stats() if step_stats is not None else {}


async def update_weights_from_disk(request: web.Request) -> web.Response:
    st = state_of(request)
    body = await read_object(request)
    model_path = body.get("model_path")
    if not isinstance(model_path, str) or not model_path:
        raise RequestError("model_path must be a non-empty string (a model directory on the server's disk)")
    if not _in_weight_dirs(model_path, st.weight_dirs):
        logger.warning("update_weights_from_disk refused %r: outside --weight-dir %s", model_path, st.weight_dirs)
        return web.json_response({"success": False, "message": OUTSIDE_WEIGHT_DIRS}, status=403)
    load_format = _field(body, "load_format", (str,), None)
    if load_format not in (None, "auto", "safetensors"):
        raise RequestError(f"load_format {load_format!r} is not supported; the embedded engine reads safetensors only")
    version = _field(body, "weight_version", (str,), None)
    pause_mode = _pause_mode(body, "pause_mode", None)
    if _field(body, "abort_all_requests", (bool,), False):
        await st.engine.abort(abort_all=True)
    try:
        await st.engine.update_weights_from_disk(model_path, weight_version=version, pause_mode=pause_mode)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        logger.warning("update_weights_from_disk(%s) failed: %s", model_path, e)
        return _update_result(False, f"failed to load {model_path}: {e}")
    return web.json_response({"success": True, "num_paused_requests": 0,
                              "message": f"Succeeded to update model weights from {model_path}; "
                                         f"weight_version is {st.engine.weight_version}.", **_step_stats(st)})


def _in_weight_dirs(model_path: str, weight_dirs: tuple[str, ...]) -> bool:
    """Whether `model_path`, symlinks resolved, is one of `weight_dirs` or inside one."""
    try:
        path = os.path.realpath(model_path)
    except (OSError, ValueError):  # a NUL byte, a path too long
        return False
    return any(path == root or path.startswith(root.rstrip(os.sep) + os.sep) for root in weight_dirs)


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    st = state_of(request)
    body = await read_object(request, st.max_weight_body_bytes, max(st.body_timeout_s, DEFAULT_WEIGHT_BODY_TIMEOUT_S))
    load_format = body.get("load_format")
    if load_format in SGLANG_PICKLE_FORMATS:
        raise RequestError(PICKLE_REFUSAL.format(fmt=load_format))
    if load_format not in (LOAD_FORMAT, LOAD_FORMAT_CUDA_IPC):
        raise RequestError(f"load_format must be {LOAD_FORMAT!r} (base64 of safetensors bytes) or "
                           f"{LOAD_FORMAT_CUDA_IPC!r} (a CUDA IPC handle table, same GPU), got {load_format!r}")
    entries = body.get("serialized_named_tensors")
    if not isinstance(entries, list) or len(entries) != 1:
        got = f"{len(entries)} entries" if isinstance(entries, list) else type(entries).__name__
        raise RequestError(f"serialized_named_tensors must be a list with one entry (the embedded engine has one rank), got {got}")
    flush = _field(body, "flush_cache", (bool,), True)
    version = _field(body, "weight_version", (str,), None)
    abort_all = _field(body, "abort_all_requests", (bool,), False)
    pause_mode = _pause_mode(body, "pause_mode", None)
    if load_format == LOAD_FORMAT_CUDA_IPC:
        ipc = _parse_cuda_ipc(st, entries[0])
        update = lambda: st.engine.update_weights_from_cuda_ipc(ipc, weight_version=version, flush_cache=flush,  # noqa: E731
                                                                pause_mode=pause_mode)
        count, how = len(ipc.tensors), " (cuda_ipc)"
    else:
        try:
            state_dict = await asyncio.to_thread(decode_named_tensors, entries[0])
        except WeightFormatError as e:
            raise RequestError(str(e)) from None
        update = lambda: st.engine.update_weights(state_dict, weight_version=version, flush_cache=flush,  # noqa: E731
                                                  pause_mode=pause_mode)
        count, how = len(state_dict), ""
    if abort_all:
        await st.engine.abort(abort_all=True)
    try:
        await update()
    except (ValueError, KeyError, RuntimeError, TypeError) as e:
        logger.warning("update_weights_from_tensor%s failed: %s", how, e)
        return _update_result(False, f"failed to update weights: {e}")
    suffix = ", cuda_ipc" if how else ""
    return _update_result(True, f"Succeeded to update model weights ({count} tensors{suffix}); "
                                f"weight_version is {st.engine.weight_version}.", _step_stats(st))


def _parse_cuda_ipc(st: ServerState, entry: Any) -> Any:
    """load_format cuda_ipc: the checked JSON handle table (slime_dsa.weights.cuda_ipc); RequestError otherwise."""
    from slime_dsa.weights.cuda_ipc import IpcFormatError, IpcWeights  # noqa: PLC0415

    if not hasattr(st.engine, "update_weights_from_cuda_ipc"):
        raise RequestError(f"load_format {LOAD_FORMAT_CUDA_IPC!r} is not supported by this engine; send {LOAD_FORMAT!r}")
    if st.last_cuda_ipc is not None and st.last_cuda_ipc[0] == entry:  # equal JSON: the checks' result is the same
        return st.last_cuda_ipc[1]
    try:
        ipc = IpcWeights.from_json(entry)
    except IpcFormatError as e:
        raise RequestError(str(e)) from None
    st.last_cuda_ipc = (entry, ipc)
    return ipc


async def unsupported_distributed(request: web.Request) -> web.Response:
    return _update_result(False, UNSUPPORTED_DISTRIBUTED.format(path=request.path))


async def memory_occupation(request: web.Request) -> web.Response:
    """release/resume_memory_occupation {"tags": null | ["weights"] | ["kv_cache"]}: 200 with body null, as SGLang."""
    body = await read_object(request)
    tags = body.get("tags")
    if tags is not None and (not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)):
        raise RequestError(f"tags must be null or a list of strings, got {tags!r}")
    engine = state_of(request).engine
    if request.path == "/release_memory_occupation":
        await engine.release_memory(tags)
    else:
        await engine.resume_memory(tags)
    return web.json_response(None)


# ---- assembly ---------------------------------------------------------------------------------------------

def create_app(
    async_engine: Any,
    tokenizer: Any = None,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_prompt_tokens: int | None = DEFAULT_MAX_PROMPT_TOKENS,
    max_weight_body_bytes: int = DEFAULT_MAX_WEIGHT_BODY_BYTES,
    model_path: str | None = None,
    served_model_name: str | None = None,
    manage_engine: bool = True,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    weight_dirs: Sequence[str] = (),
    host: str | None = None,
) -> web.Application:
    """The aiohttp application. With manage_engine, app startup/cleanup start and stop the engine.

    api_key: required (Authorization: Bearer) on every route but /health and /health_generate. weight_dirs: the only
    directories /update_weights_from_disk loads from (none: it loads nothing). host: the address it listens on; a
    keyless app on a loopback address answers only requests addressed to localhost or an IP (DNS rebinding)."""
    app = web.Application(middlewares=[_errors, _loopback_host, _auth, _json_only],
                          client_max_size=max(max_body_bytes, max_weight_body_bytes))
    st = ServerState(
        engine=async_engine, tokenizer=tokenizer, api_key=api_key, max_body_bytes=max_body_bytes,
        max_weight_body_bytes=max_weight_body_bytes, max_prompt_tokens=max_prompt_tokens,
        model_path=model_path, served_model_name=served_model_name or (model_path or "slime-dsa"),
        body_timeout_s=body_timeout_s, weight_dirs=tuple(os.path.realpath(d) for d in weight_dirs),
        loopback_only=not api_key and host is not None and is_loopback_address(host),
    )
    app[STATE] = st

    async def on_startup(app: web.Application) -> None:
        if manage_engine:
            await async_engine.start()
        st.vocab_size = async_engine.model_info().get("vocab_size")
        st.status = "ready"

    async def on_shutdown(app: web.Application) -> None:
        st.status = "stopping"

    async def on_cleanup(app: web.Application) -> None:
        st.status = "stopping"
        if manage_engine:
            await async_engine.stop()

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)

    r = app.router
    r.add_post("/generate", generate)
    for path in ("/health", "/health_generate"):
        r.add_get(path, health if path == "/health" else health_generate)
    for path in ("/get_model_info", "/model_info"):
        r.add_get(path, model_info)
    for path in ("/get_server_info", "/server_info"):
        r.add_get(path, server_info)
    r.add_get("/get_weight_version", get_weight_version)
    r.add_post("/flush_cache", flush_cache)  # POST only (SGLang also takes GET, which any web page can send)
    r.add_post("/abort_request", abort_request)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    for path in ("/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group"):
        r.add_post(path, unsupported_distributed)
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        r.add_post(path, memory_occupation)
    profiling.add_routes(app)
    openai_api.add_routes(app)
    return app
