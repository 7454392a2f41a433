"""One async client for every engine backend (embedded server, real SGLang, external URLs or an SGLang router).

Routing: a request goes to the healthy engine with the fewest outstanding requests, except that a session_id
sticks to the engine that served it while that engine stays healthy. Each engine has an in-flight cap
(semaphore). On a connection error, a timeout or a 5xx the request is retried on another engine after an
exponential backoff; an engine that fails `max_failures` times in a row is marked dead and probed on
/health until it answers again; routed to again only if it still holds the run's weight_version (a server that
restarted holds other weights: it is dropped as lost instead). 4xx answers are the caller's mistake and are raised at
once.

Lost engines: a control broadcast with drop_unreachable (the weight update's pause, update and continue) drops every
engine it cannot reach, tells the on_engine_lost listeners (the orchestrator restarts it), and goes on with the rest;
NoEnginesLeftError when none is left. A replacement is staged (stage_engine) and joins when admit_staged is called,
between the pause and the update, so that it serves only weights of the current version.

Coalescing (coalesce=True or a body size, for embedded engines: the RL loop's rollout.coalesce_calls): the generate
and generate_batch calls made in one event-loop burst that go to the same engine are sent there in batch bodies, and
any failure of a body sends each of its calls again alone (rollout/coalesce.py).

One aiohttp session with a large connection pool carries every request (see rollout/server/app.py for why
aiohttp). Responses are validated; a malformed one raises an error that names the engine and the field.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import aiohttp
import orjson
import pybase64

from rollout.coalesce import Coalescer

logger = logging.getLogger(__name__)

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"  # sglang_router's consistent_hashing policy keys on it


class EngineError(RuntimeError):
    """Base of the client's errors."""


class EngineRequestError(EngineError):
    """The engine answered 4xx: the request is wrong, retrying elsewhere would not help."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url} answered {status}: {message}")
        self.url, self.status, self.message = url, status, message


class EngineUnavailableError(EngineError):
    """Every attempt failed (connection errors, timeouts, 5xx) or no engine is configured."""


class EngineLossError(EngineUnavailableError):
    """Engines were lost and the run cannot go on without them."""


class NoEnginesLeftError(EngineLossError):
    """Every engine of the client was lost (dropped as unreachable); none is staged to replace them."""


class ClientClosedError(EngineError):
    """A call on a client that was closed: its connection pool is gone and it does not open another."""


class MalformedResponseError(EngineError):
    """An engine's response does not have SGLang's shape; the message names the engine and the field."""


@dataclass
class EngineState:
    """Routing state of one engine URL."""

    url: str
    semaphore: asyncio.Semaphore
    outstanding: int = 0  # assigned and not finished, including those waiting for the semaphore
    healthy: bool = True
    consecutive_failures: int = 0
    completed: int = 0
    failures: int = 0
    probe: asyncio.Task | None = field(default=None, repr=False)


def normalize_url(url: str) -> str:
    """'host:port' or 'http://host:port/' -> 'http://host:port'."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url


class EngineClient:
    """Async client and router over one or more engine URLs speaking SGLang's native HTTP API."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        max_inflight_per_engine: int = 256,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        max_failures: int = 3,
        probe_interval_s: float = 2.0,
        connect_timeout_s: float = 10.0,
        api_key: str | None = None,
        max_sessions: int = 100_000,
        coalesce: bool | int = False,
    ) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if max_inflight_per_engine < 1:
            raise ValueError(f"max_inflight_per_engine must be >= 1, got {max_inflight_per_engine}")
        if max_retries < 0 or backoff_s < 0 or timeout_s <= 0:
            raise ValueError(f"need max_retries >= 0, backoff_s >= 0, timeout_s > 0; got {max_retries}, {backoff_s}, {timeout_s}")
        self.max_inflight_per_engine = max_inflight_per_engine
        self.timeout_s, self.max_retries = timeout_s, max_retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.max_failures, self.probe_interval_s = max_failures, probe_interval_s
        self.connect_timeout_s = connect_timeout_s
        self.api_key = api_key
        self.engines: dict[str, EngineState] = {}
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session_id -> url, LRU-bounded
        self._max_sessions = max_sessions
        self._http: aiohttp.ClientSession | None = None
        self._closed = False
        self._rr = 0  # tie-breaker among equally loaded engines
        self._lost_listeners: list[Callable[[str, str], None]] = []
        self._staged: list[str] = []  # replacements that join at the next admit_staged
        self.lost: list[tuple[str, str]] = []  # (url, reason) of every engine dropped, in order
        # The version the run's last weight update gave every engine (set by the weight transports; None before the
        # first): a marked-dead engine that answers /health again is routed to only while it holds this version.
        self.weight_version: str | None = None
        for url in urls:
            self.add_engine(url)
        # generate / generate_batch calls of one event-loop burst go to their engine in batch bodies of at most
        # `coalesce` samples (True: the default size), rollout/coalesce.py
        self.coalescer = (Coalescer(self, EngineRequestError, _ServerError, *([] if coalesce is True else [coalesce]))
                          if coalesce else None)

    # ---- lifecycle ----------------------------------------------------------------------------------------

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def _session(self) -> aiohttp.ClientSession:
        # a call still retrying when the run shuts down must not open a pool that nobody closes
        if self._closed:
            raise ClientClosedError("the engine client is closed")
        if self._http is None or self._http.closed:
            # limit covers every engine at its cap; keep-alive connections are reused across requests
            limit = max(1024, self.max_inflight_per_engine * max(len(self.engines), 1) * 2)
            connector = aiohttp.TCPConnector(limit=limit, limit_per_host=0, ttl_dns_cache=300)
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            self._http = aiohttp.ClientSession(connector=connector, headers=headers)
        return self._http

    async def close(self) -> None:
        """Stop the health probes and close the connection pool; later calls raise ClientClosedError."""
        self._closed = True
        if self.coalescer is not None:
            await self.coalescer.close()
        probes = [e.probe for e in self.engines.values() if e.probe is not None]
        for probe in probes:
            probe.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        if self._http is not None:
            await self._http.close()
            self._http = None

    def add_engine(self, url: str) -> None:
        url = normalize_url(url)
        if url not in self.engines:
            self.engines[url] = EngineState(url, asyncio.Semaphore(self.max_inflight_per_engine))

    def replace_engine(self, old_url: str, new_url: str) -> None:
        """Route to `new_url` instead of `old_url` (an engine restarted elsewhere); requests on the old one fail and
        are retried."""
        old = self.engines.pop(normalize_url(old_url), None)
        if old is not None and old.probe is not None:
            old.probe.cancel()
        self._sessions = OrderedDict((s, u) for s, u in self._sessions.items() if u != normalize_url(old_url))
        self.add_engine(new_url)

    def on_engine_lost(self, listener: Callable[[str, str], None]) -> None:
        """Call listener(url, reason) for every engine dropped from now on."""
        self._lost_listeners.append(listener)

    def drop_engine(self, url: str, reason: str) -> bool:
        """Stop routing to `url` (lost); tells the listeners. False when it was not an engine of this client."""
        url = normalize_url(url)
        engine = self.engines.pop(url, None)
        if engine is None:
            return False
        if engine.probe is not None:
            engine.probe.cancel()
        for session in [s for s, u in self._sessions.items() if u == url]:
            del self._sessions[session]
        self.lost.append((url, reason))
        logger.warning("engine %s lost (%s); %d engine(s) left", url, reason, len(self.engines))
        for listener in self._lost_listeners:
            listener(url, reason)
        return True

    def stage_engine(self, url: str) -> None:
        """A new engine that joins at the next admit_staged (the weight update: it must get the current weights)."""
        self._staged.append(normalize_url(url))

    @property
    def staged(self) -> list[str]:
        return list(self._staged)

    def unstage(self, url: str, reason: str) -> None:
        """A staged engine that died before it joined: lost (the listeners hear of it)."""
        url = normalize_url(url)
        if url in self._staged:
            self._staged.remove(url)
            self.lost.append((url, reason))
            logger.warning("engine %s lost before it joined (%s)", url, reason)
            for listener in self._lost_listeners:
                listener(url, reason)

    def admit_staged(self) -> list[str]:
        """Route to the staged engines from now on; returns their URLs."""
        admitted, self._staged = self._staged, []
        for url in admitted:
            self.add_engine(url)
            logger.info("engine %s joined (%d engine(s))", url, len(self.engines))
        return admitted

    def stats(self) -> dict[str, dict]:
        """Per engine: outstanding, completed, failures, healthy."""
        return {u: {"outstanding": e.outstanding, "completed": e.completed, "failures": e.failures,
                    "healthy": e.healthy} for u, e in self.engines.items()}

    # ---- routing ------------------------------------------------------------------------------------------

    def pick(self, session_id: str | None = None, exclude: set[str] = frozenset()) -> EngineState:
        """The engine for the next attempt: the session's engine if healthy, else the least outstanding."""
        if not self.engines:
            raise EngineUnavailableError(f"no engine left ({self._lost_summary()})" if self.lost
                                         else "no engine URLs are configured")
        if session_id is not None:
            url = self._sessions.get(session_id)
            engine = self.engines.get(url) if url else None
            if engine is not None and engine.healthy and url not in exclude:
                self._sessions.move_to_end(session_id)
                return engine
        pool = [e for e in self.engines.values() if e.healthy and e.url not in exclude]
        if not pool:  # every healthy engine was tried: a dead one may be back, an excluded one may work now
            pool = [e for e in self.engines.values() if e.url not in exclude] or list(self.engines.values())
        low = min(e.outstanding for e in pool)
        ties = [e for e in pool if e.outstanding == low]
        self._rr += 1
        engine = ties[self._rr % len(ties)]
        if session_id is not None:
            self._sessions[session_id] = engine.url
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        return engine

    def _record_failure(self, engine: EngineState, reason: str) -> None:
        engine.failures += 1
        engine.consecutive_failures += 1
        if engine.healthy and engine.consecutive_failures >= self.max_failures:
            engine.healthy = False
            logger.warning("engine %s marked dead after %d failures in a row (%s); probing /health",
                           engine.url, engine.consecutive_failures, reason)
            if not self._closed and (engine.probe is None or engine.probe.done()):
                engine.probe = asyncio.create_task(self._probe(engine))

    async def _probe(self, engine: EngineState) -> None:
        """Poll /health of a dead engine until it answers 200, then route to it again."""
        timeout = aiohttp.ClientTimeout(total=max(2.0, self.probe_interval_s))
        while not engine.healthy and engine.url in self.engines and not self._closed:
            await asyncio.sleep(self.probe_interval_s)
            try:
                async with self._session().get(engine.url + "/health", timeout=timeout) as resp:
                    answered = resp.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue
            if answered:
                await self._route_again(engine)

    async def _route_again(self, engine: EngineState) -> None:
        """A marked-dead engine answers /health: routed to again if it holds the run's weights, else dropped as lost
        (it restarted: its listeners re-admit it at a weight update, which gives it the run's weights)."""
        held = await self.weight_version_of(engine.url) if self.weight_version is not None else None
        if self.weight_version is None or held == self.weight_version:
            engine.healthy, engine.consecutive_failures = True, 0
            logger.info("engine %s is healthy again", engine.url)
            return
        engine.probe = None  # this task: it ends here, not cancelled by the drop
        self.drop_engine(engine.url, f"it came back holding weight_version {held!r}, not the run's "
                                     f"{self.weight_version!r} (restarted?)")

    async def weight_version_of(self, url: str) -> str | None:
        """The weight_version an engine reports (GET /get_weight_version, or newer servers' /model_info), or None
        when it reports none or cannot be reached."""
        for path in ("/get_weight_version", "/model_info", "/get_model_info"):
            try:
                body = await self.get(url, path, timeout_s=5.0)
            except (EngineRequestError, aiohttp.ClientError, asyncio.TimeoutError):
                continue
            if isinstance(body, dict) and body.get("weight_version") is not None:
                return str(body["weight_version"])
        return None

    async def answers_health(self, url: str, timeout_s: float = 5.0) -> bool:
        """Whether GET /health on `url` answers 200 within `timeout_s`."""
        try:
            async with self._session().get(normalize_url(url) + "/health",
                                           timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    # ---- requests -----------------------------------------------------------------------------------------

    async def _post_once(self, engine: EngineState, path: str, payload: Any, headers: dict | None,
                         timeout_s: float) -> Any:
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.connect_timeout_s)
        async with self._session().post(engine.url + path, json=_body(payload), headers=headers, timeout=timeout) as resp:
            if resp.status >= 400:
                text = await resp.text()
                message = _error_message(text)
                if resp.status >= 500:
                    raise _ServerError(resp.status, message)
                raise EngineRequestError(engine.url, resp.status, message)
            body = await resp.read()
            try:
                return _loads(body)
            except ValueError:
                raise MalformedResponseError(f"{engine.url}{path} answered {resp.status} with a body that is not JSON") from None

    async def request(self, path: str, payload: Any, *, session_id: str | None = None,
                      timeout_s: float | None = None, abort_rid: str | Sequence[str] | None = None) -> tuple[Any, str]:
        """POST `payload` to `path` on one engine, routed and retried; returns (JSON body, engine URL).
        abort_rid: the request id(s) to abort on an engine whose attempt timed out."""
        timeout_s = timeout_s or self.timeout_s
        headers = {ROUTING_KEY_HEADER: session_id} if session_id else None
        tried: set[str] = set()
        last: str | None = None
        errors: list[str] = []
        attempt = 0
        while attempt <= self.max_retries:
            # a retry goes to an engine not yet tried; once all were tried, to any but the one that just failed
            exclude = tried if len(tried) < len(self.engines) else {last}
            engine = self.pick(session_id, exclude=exclude)
            tried.add(engine.url)
            last = engine.url
            engine.outstanding += 1
            try:
                async with engine.semaphore:
                    if not engine.healthy and any(e.healthy for e in self.engines.values() if e is not engine):
                        tried = {engine.url}  # it died while this request waited for it: re-route, no attempt spent
                        continue
                    body = await self._post_once(engine, path, payload, headers, timeout_s)
            except EngineRequestError:
                engine.consecutive_failures = 0  # it answered: the engine is alive
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, _ServerError) as e:
                reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                errors.append(f"{engine.url}: {reason}")
                self._record_failure(engine, reason)
                if isinstance(e, asyncio.TimeoutError) and abort_rid:
                    # the request may still run there: end it before it is sent again (the rid must be free)
                    for rid in [abort_rid] if isinstance(abort_rid, str) else abort_rid:
                        await self._abort(engine.url, rid)
                logger.info("attempt %d of %s on %s failed: %s", attempt + 1, path, engine.url, reason)
                attempt += 1
                if attempt <= self.max_retries:
                    delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
                    await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                continue
            finally:
                engine.outstanding -= 1
            engine.consecutive_failures = 0
            engine.completed += 1
            return body, engine.url
        raise EngineUnavailableError(f"{path} failed after {self.max_retries + 1} attempts: " + "; ".join(errors[-4:]))

    async def _abort(self, url: str, rid: str) -> None:
        """Best-effort POST /abort_request for a timed-out request."""
        try:
            timeout = aiohttp.ClientTimeout(total=5)
            async with self._session().post(url + "/abort_request", json={"rid": rid}, timeout=timeout):
                pass
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict | None = None,
        *,
        return_logprob: bool = True,
        session_id: str | None = None,
        return_indexer_topk: bool = False,
        indexer_topk_start_len: int = -1,
        rid: str | None = None,
        timeout_s: float | None = None,
    ) -> dict | list[dict]:
        """POST /generate with token ids; returns SGLang's response dict (validated), a list of n of them when
        sampling_params has n > 1 (rids `{rid}_{j}`, as SGLang and our server name them).

        indexer_topk_start_len >= 0 (with return_indexer_topk) asks for the prompt rows' top-k too, from that row on
        (docs/sglang.md); `indexer_topk_rows` reads the reply."""
        rid = rid or uuid.uuid4().hex
        payload: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params or {}),
                                   "return_logprob": return_logprob, "rid": rid}
        add_generate_options(payload, session_id, return_indexer_topk, indexer_topk_start_len)
        n = payload["sampling_params"].get("n", 1)
        body, url = await self._generate_call(payload, session_id, timeout_s,
                                              [rid] if n == 1 else [f"{rid}_{j}" for j in range(n)])
        items = body if isinstance(body, list) else [body]
        if n > 1 and (not isinstance(body, list) or len(body) != n):
            raise MalformedResponseError(f"{url}/generate: expected a list of {n} results for n={n}")
        for i, item in enumerate(items):
            validate_generate_response(item, url, return_logprob=return_logprob, where=f"[{i}]" if n > 1 else "")
        return body

    async def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: Sequence[dict],
        *,
        return_logprob: bool = True,
        session_id: str | None = None,
        return_indexer_topk: bool = False,
        indexer_topk_start_len: int = -1,
        timeout_s: float | None = None,
    ) -> list[dict]:
        """POST /generate with a batch of token-id prompts, one sampling_params dict each, in ONE request (one
        engine); returns the validated response dicts in order. Same options as `generate`."""
        if not prompts or len(prompts) != len(sampling_params):
            raise ValueError(f"need one sampling_params per prompt, got {len(prompts)} prompts and "
                             f"{len(sampling_params)} sampling_params")
        rids = [uuid.uuid4().hex for _ in prompts]
        payload: dict[str, Any] = {"input_ids": [list(p) for p in prompts],
                                   "sampling_params": [dict(sp) for sp in sampling_params],
                                   "return_logprob": return_logprob, "rid": rids}
        add_generate_options(payload, session_id, return_indexer_topk, indexer_topk_start_len)
        body, url = await self._generate_call(payload, session_id, timeout_s, rids)
        if not isinstance(body, list) or len(body) != len(prompts):
            raise MalformedResponseError(f"{url}/generate: expected a list of {len(prompts)} results for a batch of "
                                         f"{len(prompts)} prompts, got {str(body)[:120]!r}")
        for i, item in enumerate(body):
            validate_generate_response(item, url, return_logprob=return_logprob, where=f"[{i}]")
        return body

    async def _generate_call(self, payload: dict, session_id: str | None, timeout_s: float | None,
                             abort_rids: list[str]) -> tuple[Any, str]:
        """POST a generate / generate_batch body: merged with its burst's when coalescing, else routed alone."""
        if self.coalescer is not None:
            return await self.coalescer.generate(payload, session_id=session_id, timeout_s=timeout_s or self.timeout_s,
                                                 abort_rids=abort_rids)
        return await self.request("/generate", payload, session_id=session_id, timeout_s=timeout_s,
                                  abort_rid=abort_rids)

    async def generate_raw(self, payload: dict, *, session_id: str | None = None, timeout_s: float | None = None) -> Any:
        """POST /generate with any SGLang payload (text, batches, ...); routed and retried, not validated."""
        body, _ = await self.request("/generate", payload, session_id=session_id, timeout_s=timeout_s,
                                     abort_rid=payload.get("rid") if isinstance(payload.get("rid"), str) else None)
        return body

    async def broadcast(self, path: str, json: Any = None, *, method: str = "POST", timeout_s: float | None = None,
                        check: bool = True, healthy_only: bool = False,
                        drop_unreachable: bool = False) -> dict[str, Any]:
        """Send one control request (pause, flush, update weights, ...) to every engine at once.

        Returns {url: parsed body (JSON, else text)}; with `check`, raises EngineError naming each engine that
        failed (status >= 400 or unreachable). Not retried: control calls are not idempotent in general.
        drop_unreachable: an engine that cannot be reached (connection refused or reset, timeout) is dropped as lost
        and left out of the reply; NoEnginesLeftError when that leaves none.
        """
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s, sock_connect=self.connect_timeout_s)
        targets = [e for e in self.engines.values() if e.healthy or not healthy_only]

        async def one(engine: EngineState) -> tuple[str, Any, str | None, bool]:
            try:
                body = _body(json) if method == "POST" else json
                async with self._session().request(method, engine.url + path, json=body, timeout=timeout) as resp:
                    text = await resp.text()
                    body = _parse_body(text)
                    return engine.url, body, None if resp.status < 400 else f"{resp.status}: {_error_message(text)}", False
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                return engine.url, None, f"{type(e).__name__}: {e}", True

        results = await asyncio.gather(*(one(e) for e in targets))
        if drop_unreachable:
            for url, _, err, unreachable in results:
                if unreachable:
                    self.drop_engine(url, f"{method} {path}: {err}")
            results = [r for r in results if not r[3]]
            if not self.engines and not self._staged:
                raise NoEnginesLeftError(f"every engine was lost: {self._lost_summary()}")
        failed = [f"{url} ({err})" for url, _, err, _ in results if err]
        if check and failed:
            raise EngineError(f"{method} {path} failed on {len(failed)} of {len(results)} engines: " + "; ".join(failed))
        return {url: body for url, body, _, _ in results}

    def _lost_summary(self) -> str:
        last = "; ".join(f"{url} ({reason})" for url, reason in self.lost[-3:])
        return f"{len(self.lost)} dropped, the last {last}" if self.lost else "none configured"

    async def post_to(self, url: str, path: str, json: Any = None, *, timeout_s: float | None = None) -> Any:
        """POST to one named engine, not routed or retried; EngineError naming the engine on failure."""
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s, sock_connect=self.connect_timeout_s)
        try:
            async with self._session().post(normalize_url(url) + path, json=_body(json), timeout=timeout) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise EngineRequestError(url, resp.status, _error_message(text))
                return _parse_body(text)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise EngineUnavailableError(f"POST {url}{path} failed: {type(e).__name__}: {e}") from e

    async def get(self, url: str, path: str, *, timeout_s: float = 10.0) -> Any:
        """GET `path` on one engine (info endpoints)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self._session().get(normalize_url(url) + path, timeout=timeout) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise EngineRequestError(url, resp.status, _error_message(text))
            return _parse_body(text)

    async def wait_healthy(self, timeout_s: float = 600.0, interval_s: float = 0.5) -> None:
        """Block until every engine answers /health with 200."""
        deadline = time.monotonic() + timeout_s
        pending = set(self.engines)
        while pending:
            for url in list(pending):
                try:
                    async with self._session().get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                        if r.status == 200:
                            pending.discard(url)
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
            if pending:
                if time.monotonic() > deadline:
                    raise EngineUnavailableError(f"engines not healthy after {timeout_s:.0f}s: {sorted(pending)}")
                await asyncio.sleep(interval_s)


def _loads(body: bytes) -> Any:
    """A response's JSON (None when empty) by orjson, ~3x the standard library on /generate answers (1,024 short
    answers with log-probs: 21 → 8 ms on one CPU core, in the orchestrator's event loop); by the standard library
    where orjson refuses what it accepts (NaN and Infinity literals, which SGLang's orjson never writes)."""
    if not body.strip():
        return None
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return json.loads(body)


def _body(payload: Any) -> Any:
    """A POST's JSON, {} for none: servers refuse a POST without Content-Type: application/json (browser CSRF)."""
    return {} if payload is None else payload


class _ServerError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")


def _parse_body(text: str) -> Any:
    try:
        return json.loads(text) if text.strip() else None
    except ValueError:
        return text


def _error_message(text: str) -> str:
    body = _parse_body(text)
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
        if isinstance(err, str):
            return err
    return str(text)[:500]


def add_generate_options(payload: dict[str, Any], session_id: str | None, return_indexer_topk: bool,
                         indexer_topk_start_len: int) -> None:
    """The optional /generate fields `generate` and `generate_batch` share (and InProcessClient's)."""
    if session_id is not None:
        payload["session_id"] = session_id
    if return_indexer_topk:
        payload["return_indexer_topk"] = True
        if indexer_topk_start_len >= 0:
            payload["indexer_topk_start_len"] = indexer_topk_start_len


def n_sample_params(sampling_params: dict, seeds: Sequence[int]) -> dict | None:
    """One sampling_params dict for len(seeds) samples of one prompt seeded `seeds`, or None unless the seeds are
    consecutive: `n` and the first seed, since our embedded server gives sample j seed sampling_seed + j
    (docs/sglang.md). SGLang gives all n samples the same seed: send this to embedded engines only."""
    if len(seeds) < 2 or list(seeds) != list(range(seeds[0], seeds[0] + len(seeds))):
        return None
    return {**sampling_params, "n": len(seeds), "sampling_seed": seeds[0]}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate_generate_response(body: Any, url: str, *, return_logprob: bool, where: str = "") -> None:
    """Check SGLang's /generate response shape; MalformedResponseError names the engine and the field."""
    def bad(field_name: str, expected: str, got: Any) -> MalformedResponseError:
        return MalformedResponseError(f"{url}/generate returned {where}{field_name} = {str(got)[:120]!r}, expected {expected}")

    if not isinstance(body, dict):
        raise bad("(body)", "a JSON object", body)
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise bad("meta_info", "an object", meta)
    reason = meta.get("finish_reason")
    if not isinstance(reason, dict) or not isinstance(reason.get("type"), str):
        raise bad("meta_info.finish_reason", "an object with a string 'type'", reason)
    for key in ("prompt_tokens", "completion_tokens"):
        if not _is_int(meta.get(key)) or meta[key] < 0:
            raise bad(f"meta_info.{key}", "a non-negative integer", meta.get(key))
    output_ids = body.get("output_ids")
    if output_ids is not None and (not isinstance(output_ids, list) or not _all_of(output_ids, _INT)):
        raise bad("output_ids", "a list of integer token ids", output_ids)
    if return_logprob:
        lps = meta.get("output_token_logprobs")
        if not isinstance(lps, list):
            raise bad("meta_info.output_token_logprobs", "a list of [logprob, token_id, text]", lps)
        ids = _logprob_token_ids(lps)
        if ids is None:  # a bad entry: find and name it
            for i, entry in enumerate(lps):
                if (not isinstance(entry, (list, tuple)) or len(entry) < 2 or not _is_int(entry[1])
                        or not isinstance(entry[0], (int, float)) or isinstance(entry[0], bool)):
                    raise bad(f"meta_info.output_token_logprobs[{i}]", "[logprob, token_id, text]", entry)
            ids = [e[1] for e in lps]
        if len(lps) != meta["completion_tokens"]:
            raise bad("meta_info.output_token_logprobs", f"{meta['completion_tokens']} entries (completion_tokens)", f"{len(lps)} entries")
        if output_ids is not None and lps and ids != output_ids[-len(lps):]:
            raise bad("meta_info.output_token_logprobs", "token ids equal to output_ids", ids[:8])


# Exact types: a bool is not a number here.
_INT, _NUMBER, _ENTRY = frozenset({int}), frozenset({int, float}), frozenset({list, tuple})


def _all_of(values: list, types: frozenset) -> bool:
    """Whether every value's type is one of `types`: one pass in C (the per-token checks of 1,024 answers took
    ~10 ms of the orchestrator's event loop as a Python loop)."""
    return set(map(type, values)) <= types


def _logprob_token_ids(entries: list) -> list[int] | None:
    """The token ids of [logprob, token_id, ...] entries, or None when any entry may not be one (an empty list too)."""
    if not _all_of(entries, _ENTRY):
        return None
    columns = list(zip(*entries))  # cut to the shortest entry: fewer than two columns when one is too short
    if len(columns) < 2 or not _all_of(columns[1], _INT) or not _all_of(columns[0], _NUMBER):
        return None
    return list(columns[1])


def output_tokens(response: dict) -> tuple[list[int], list[float]]:
    """(token ids, log-probs) of the output, read from meta_info.output_token_logprobs as slime does."""
    lps = response["meta_info"]["output_token_logprobs"]
    return [int(e[1]) for e in lps], [float(e[0]) for e in lps]


def decode_indexer_topk(meta_info: dict, shape: Sequence[int] | None = None) -> Any:
    """meta_info.indexer_topk (base64 int32) as a numpy array; shape from meta_info.indexer_topk_shape if absent."""
    import numpy as np

    if meta_info.get("indexer_topk") is None:
        return None
    arr = np.frombuffer(pybase64.b64decode(meta_info["indexer_topk"]), dtype="<i4")  # SIMD: replay rows are large
    shape = shape or meta_info.get("indexer_topk_shape")
    return arr.reshape(shape) if shape is not None else arr


def indexer_topk_rows(meta_info: dict) -> tuple[Any, int | None]:
    """(top-k array (rows, n_full_layers, index_topk), the sequence row of its first entry), or (None, None).

    The embedded engine says where the rows start (meta_info.indexer_topk_start); without it the rows are SGLang's
    (every row but the last, from row 0) when they number prompt + completion - 1, else one per output token.
    """
    arr = decode_indexer_topk(meta_info)
    if arr is None:
        return None, None
    if arr.ndim != 3:
        raise MalformedResponseError(f"meta_info.indexer_topk has shape {arr.shape}; (rows, layers, topk) needs "
                                     "meta_info.indexer_topk_shape")
    start = meta_info.get("indexer_topk_start")
    prompt, completion = int(meta_info["prompt_tokens"]), int(meta_info["completion_tokens"])
    if start is None:
        start = 0 if len(arr) == prompt + completion - 1 and len(arr) != completion else prompt - 1
    if not _is_int(start) or start < 0 or start + len(arr) != prompt + completion - 1:
        raise MalformedResponseError(
            f"meta_info.indexer_topk covers rows {start} .. {start + len(arr) - 1}, expected rows ending at "
            f"{prompt + completion - 2} (prompt_tokens {prompt} + completion_tokens {completion} - 2)")
    return arr, int(start)
