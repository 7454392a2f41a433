"""POST /start_profile and /stop_profile, as SGLang's: a torch.profiler trace of this engine's process between the
two, written to the output_dir the start named (slime_dsa/trace_recorder.py). Like every route but the
health checks, they need the server's API key when it has one."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web

from rollout.engine.types import RequestError
from rollout.server.bodies import read_object
from rollout.server.state import state_of
from slime_dsa.trace_recorder import ACTIVITIES, ProfileError, TraceRecorder

RECORDER = web.AppKey("profile_recorder", TraceRecorder)
START_KEYS = frozenset({"output_dir", "activities", "num_steps", "with_stack", "record_shapes"})


def trace_name(request: web.Request) -> str:
    """engine-<host>-<port>: unique among a run's engines, which all write into one directory."""
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    port = sockname[1] if isinstance(sockname, tuple) and len(sockname) > 1 else 0
    return f"engine-{socket.gethostname()}-{port}".replace("/", "_")


def _check_start(body: dict) -> tuple[str, list[str]]:
    """(output_dir, activities) of a /start_profile body; RequestError naming the first field this engine cannot
    honour."""
    unknown = sorted(set(body) - START_KEYS)
    if unknown:
        raise RequestError(f"unknown /start_profile field {unknown[0]!r}; this engine takes {sorted(START_KEYS)}")
    output_dir = body.get("output_dir")
    if not isinstance(output_dir, str) or not output_dir:
        raise RequestError("output_dir must be a non-empty string (the directory the trace is written to)")
    activities = body.get("activities")
    if activities is None:
        activities = list(ACTIVITIES)
    if not isinstance(activities, list) or not activities or not set(activities) <= set(ACTIVITIES):
        raise RequestError(f"activities must be null or a non-empty list of {list(ACTIVITIES)}, got {activities!r}")
    if body.get("num_steps") is not None:
        raise RequestError("num_steps is not supported: the profile runs until /stop_profile")
    for flag in ("with_stack", "record_shapes"):
        if body.get(flag):
            raise RequestError(f"{flag} is not supported by this engine's profiler; send false or leave it out")
    return output_dir, activities


async def _on_engine_thread(request: web.Request, fn: Callable[[], Any]) -> Any:
    """fn on the engine's own thread between steps (the profiler records the ops of the thread that starts it)."""
    return await state_of(request).engine.on_engine_thread(fn)


async def start_profile(request: web.Request) -> web.Response:
    output_dir, activities = _check_start(await read_object(request))
    recorder, name = request.app[RECORDER], trace_name(request)
    try:
        await _on_engine_thread(request, lambda: recorder.start(output_dir, name, activities))
    except (ProfileError, OSError) as e:
        raise RequestError(f"cannot start the profile: {e}") from None
    return web.Response(text="Start profiling.\n")


async def stop_profile(request: web.Request) -> web.Response:
    await read_object(request)
    try:
        path = await _on_engine_thread(request, request.app[RECORDER].stop)
    except ProfileError as e:
        raise RequestError(str(e)) from None
    return web.Response(text=f"Stop profiling. The trace is in {path}.\n")


def add_routes(app: web.Application) -> None:
    app[RECORDER] = TraceRecorder()
    app.router.add_post("/start_profile", start_profile)
    app.router.add_post("/stop_profile", stop_profile)
