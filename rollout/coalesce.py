"""Batch /generate bodies per engine for the group calls of one event-loop burst (embedded engines only).

An RL step's groups each call `EngineClient.generate` at once; sent one by one, the calls reach the engine over
40-80 ms while it waits for the burst (issue 19). With coalescing, a call picks its engine at once (its session's,
else the least loaded, as an uncoalesced call would, and counts as outstanding there) and waits; when the event loop
next runs its ready callbacks (`call_soon`), the waiting calls that go to the same engine with the same `n`, flags
and timeout are sent, in order, as batch bodies of at most `max_generations` samples (a call is never split), in
SGLang's batch form: `input_ids`, `sampling_params` and `rid` as lists. Each prompt keeps its seed and rid, so its
samples are those it would get alone (the server seeds sample j of prompt i `sampling_seed_i + j` and names it
`{rid_i}_{j}`). The answer, prompt-major, is split back per call.

Failure isolation: when a merged body fails in any way (4xx or 5xx answer, timeout, connection error, an answer
that is not a list of the right length), its calls' rids are aborted on that engine after a timeout, the failure
counts once against the engine (not for a 4xx), and every call is sent again ALONE, in its caller's task, through
`EngineClient.request` with its full retry budget: a bad prompt then fails only its own call. A lone call of a burst
goes alone from the start. A caller that cancels its call inside a merged body on the wire gets its rids aborted
there. Costs: a merged call answers when its slowest member does, and a failed merge costs its members one more
round trip (up to one more timeout).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import aiohttp

logger = logging.getLogger(__name__)

# Our server refuses a body that expands to more generations (rollout.server.protocol.MAX_EXPANDED_REQUESTS).
MAX_MERGED_GENERATIONS = 4096
# Samples per merged body by default (rollout.coalesce_max_samples): a body answers when its slowest sample ends and
# its answers are built and parsed in one piece after that, so one body per burst moved that work behind the last
# engine step (benchmarks/RESULTS.md, 2026-12-03); bodies of 64 samples kept the gain with the least of it.
DEFAULT_MAX_SAMPLES = 64
# Prompt tokens per merged body: ~8 bytes of JSON each keeps it under the server's 16 MiB body limit.
MAX_MERGED_PROMPT_TOKENS = 1 << 20
# Fields that become lists in the merged body; every other field must be equal for calls to merge.
_PER_PROMPT = ("input_ids", "sampling_params", "rid")
_ALONE = object()  # a call's future result: send it alone (a lone call, or its merged body failed)


@dataclass(eq=False)
class _Call:
    """One waiting /generate call."""

    payload: dict[str, Any]
    session_id: str | None
    timeout_s: float
    abort_rids: list[str]
    engine: Any  # rollout.client.EngineState where it was routed (and counted as outstanding) when it came
    future: asyncio.Future = field(repr=False)
    generations: int = 1
    tokens: int = 0
    sent: bool = False  # inside a merged body on the wire


def _prompts(payload: dict) -> list[list[int]]:
    ids = payload["input_ids"]
    return ids if ids and isinstance(ids[0], list) else [ids]


def _n_of(payload: dict) -> int | None:
    """The call's `n` (one for all its prompts), None when its prompts disagree or it is not a positive int."""
    params = payload.get("sampling_params") or {}
    ns = [(p or {}).get("n", 1) if isinstance(p, dict) or p is None else None
          for p in (params if isinstance(params, list) else [params])]
    ok = all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in ns)
    return ns[0] if ok and len(set(ns)) == 1 else None


def merge_key(payload: dict, timeout_s: float) -> tuple | None:
    """What calls must share to go in one body (n, every top-level flag, the timeout), or None when this call never
    merges (a text prompt, a stream, a field that is not a plain value)."""
    if not payload.get("input_ids") or payload.get("text") is not None or payload.get("stream"):
        return None
    n = _n_of(payload)
    flags = tuple(sorted((k, v) for k, v in payload.items() if k not in _PER_PROMPT and k != "session_id"))
    if n is None or not all(isinstance(v, Hashable) and not isinstance(v, (list, dict)) for _, v in flags):
        return None
    return (n, timeout_s, flags)


def merge_bodies(payloads: Sequence[dict]) -> dict[str, Any]:
    """One batch /generate body holding every prompt of `payloads` in order, each with its sampling_params and rid;
    the session_id only when they all share it (the engine uses it as a hint only)."""
    ids: list[list[int]] = []
    params: list[dict] = []
    rids: list[str] = []
    for p in payloads:
        prompts = _prompts(p)
        sp, rid = p.get("sampling_params") or {}, p.get("rid")
        ids.extend(prompts)
        params.extend(sp if isinstance(sp, list) else [sp] * len(prompts))
        rids.extend(rid if isinstance(rid, list) else [rid] * len(prompts))
    merged = {k: v for k, v in payloads[0].items() if k not in _PER_PROMPT and k != "session_id"}
    merged.update(input_ids=ids, sampling_params=params, rid=rids)
    sessions = {p.get("session_id") for p in payloads}
    if len(sessions) == 1 and None not in sessions:
        merged["session_id"] = sessions.pop()
    return merged


def split_answer(body: Any, payloads: Sequence[dict], n: int) -> list[Any]:
    """The merged answer cut into each call's own answer: a dict for a single prompt with n = 1, else a list."""
    sizes = [len(_prompts(p)) * n for p in payloads]
    if not isinstance(body, list) or len(body) != sum(sizes):
        raise ValueError(f"expected a list of {sum(sizes)} results, got {str(body)[:120]!r}")
    parts, at = [], 0
    for p, size in zip(payloads, sizes):
        single = not (p["input_ids"] and isinstance(p["input_ids"][0], list)) and n == 1
        parts.append(body[at] if single else body[at: at + size])
        at += size
    return parts


def chunks(calls: list[_Call], max_generations: int = DEFAULT_MAX_SAMPLES) -> list[list[_Call]]:
    """`calls` in order, cut so that no body exceeds max_generations or MAX_MERGED_PROMPT_TOKENS."""
    out: list[list[_Call]] = []
    gens = tokens = 0
    for call in calls:
        if out and (gens + call.generations > max_generations or tokens + call.tokens > MAX_MERGED_PROMPT_TOKENS):
            out.append([])
            gens = tokens = 0
        if not out:
            out.append([])
        out[-1].append(call)
        gens, tokens = gens + call.generations, tokens + call.tokens
    return out


class Coalescer:
    """Merges an EngineClient's /generate calls per burst and engine; `counts`: bodies sent merged, calls in them,
    calls sent alone (lone in their burst, not mergeable, or after a failed merge)."""

    def __init__(self, client: Any, request_error: type[Exception], server_error: type[Exception],
                 max_generations: int = DEFAULT_MAX_SAMPLES) -> None:
        """client: the rollout.client.EngineClient whose calls merge (that module imports this one, so it hands over
        its error types too): request_error, an engine's 4xx answer; server_error, its 5xx answer."""
        if not 1 <= max_generations <= MAX_MERGED_GENERATIONS:
            raise ValueError(f"max_generations must be in [1, {MAX_MERGED_GENERATIONS}], got {max_generations}")
        self.client, self.max_generations = client, max_generations
        self.request_error, self.server_error = request_error, server_error
        self._waiting: dict[tuple, list[_Call]] = {}
        self._flush_scheduled = False
        self._tasks: set[asyncio.Future] = set()
        self.counts: Counter[str] = Counter()

    async def generate(self, payload: dict, *, session_id: str | None, timeout_s: float,
                       abort_rids: list[str]) -> tuple[Any, str]:
        """(the call's answer, engine URL), as EngineClient.request gives it, its body merged with its burst's."""
        key = merge_key(payload, timeout_s)
        if key is None or not self.client.engines:
            return await self._alone(payload, session_id, timeout_s, abort_rids)
        engine = self.client.pick(session_id)
        engine.outstanding += 1
        loop = asyncio.get_running_loop()
        prompts = _prompts(payload)
        call = _Call(payload, session_id, timeout_s, abort_rids, engine, loop.create_future(),
                     generations=len(prompts) * key[0], tokens=sum(map(len, prompts)))
        call.future.add_done_callback(lambda f: self._cancelled(call) if f.cancelled() else None)
        self._waiting.setdefault((engine.url, key), []).append(call)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        result = await call.future
        if result is _ALONE:
            return await self._alone(payload, session_id, timeout_s, abort_rids)
        return result

    def requests_sent(self) -> int:
        """/generate bodies sent so far: merged ones (answered or failed) and calls sent alone (first attempts)."""
        return self.counts["merged_bodies"] + self.counts["failed_merges"] + self.counts["alone"]

    async def _alone(self, payload: dict, session_id: str | None, timeout_s: float,
                     abort_rids: list[str]) -> tuple[Any, str]:
        self.counts["alone"] += 1
        return await self.client.request("/generate", payload, session_id=session_id, timeout_s=timeout_s,
                                         abort_rid=abort_rids)

    def _flush(self) -> None:
        """Send what waited: each engine's compatible calls merged (in chunks), a lone one alone."""
        self._flush_scheduled = False
        waiting, self._waiting = self._waiting, {}
        for (url, key), calls in waiting.items():
            live = [c for c in calls if not c.future.done()]
            for c in calls:
                if c.future.done():  # cancelled before it was sent
                    c.engine.outstanding -= 1
            for chunk in chunks(live, self.max_generations):
                if len(chunk) == 1:
                    chunk[0].engine.outstanding -= 1  # request() counts it again
                    chunk[0].future.set_result(_ALONE)
                    continue
                task = asyncio.ensure_future(self._send(url, key[0], chunk))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _send(self, url: str, n: int, calls: list[_Call]) -> None:
        """POST one merged body to `url`; each call gets its part, or _ALONE when the body failed."""
        client, engine = self.client, calls[0].engine
        payloads = [c.payload for c in calls]
        merged = merge_bodies(payloads)
        sid = merged.get("session_id")
        headers = {"X-SMG-Routing-Key": sid} if sid else None
        parts: list[Any] | None = None
        try:
            if client.engines.get(url) is not engine or not engine.healthy:
                return  # dropped or marked dead since the calls came: each goes alone (routed afresh)
            async with engine.semaphore:
                for c in calls:
                    c.sent = True
                body = await client._post_once(engine, "/generate", merged, headers, calls[0].timeout_s)
            parts = split_answer(body, payloads, n)
        except asyncio.CancelledError:
            for c in calls:
                c.future.cancel()
            raise
        except self.request_error as e:  # one prompt may be at fault: each call alone finds out which
            engine.consecutive_failures = 0
            logger.info("a merged /generate of %d calls on %s answered %d (%s); sending them alone", len(calls), url,
                        e.status, e.message[:200])
        except Exception as e:  # noqa: BLE001 - whatever went wrong, each call alone gets today's handling of it
            reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            logger.info("a merged /generate of %d calls on %s failed (%s); sending them alone", len(calls), url, reason)
            if isinstance(e, (aiohttp.ClientError, asyncio.TimeoutError, self.server_error)):
                client._record_failure(engine, reason)
            if isinstance(e, asyncio.TimeoutError):  # they may still run there: free their rids before they go again
                await asyncio.gather(*(client._abort(url, rid) for c in calls for rid in c.abort_rids))
        finally:
            engine.outstanding -= len(calls)
            if parts is None:
                self.counts["failed_merges" if calls[0].sent else "rerouted_merges"] += 1
                for c in calls:
                    c.sent = False
                    if not c.future.done():
                        c.future.set_result(_ALONE)
        if parts is None:
            return
        engine.consecutive_failures = 0
        engine.completed += len(calls)
        self.counts["merged_bodies"] += 1
        self.counts["merged_calls"] += len(calls)
        for c, part in zip(calls, parts):
            if not c.future.done():
                c.future.set_result((part, url))

    def _cancelled(self, call: _Call) -> None:
        """A caller gave up on a call inside a merged body on the wire: end its samples there (the rest go on)."""
        if call.sent:
            task = asyncio.ensure_future(asyncio.gather(*(self.client._abort(call.engine.url, rid)
                                                          for rid in call.abort_rids)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Cancel the merged bodies in flight (their callers' calls are cancelled)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
