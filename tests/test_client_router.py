"""EngineClient (routing, retries, health) against TWO real embedded engines, each a `python -m rollout.server`
subprocess on 127.0.0.1 serving a tiny random GLM-MoE-DSA checkpoint on CPU. One engine is SIGKILLed in the
middle of 1,000 concurrent requests; every request must still complete, exactly once, with its own answer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.client import (
    ClientClosedError, EngineClient, EngineError, EngineRequestError, EngineUnavailableError, MalformedResponseError,
    validate_generate_response,
)
from tests.hf_reference import make_hf_checkpoint
from trainers.process_group import free_port

logger = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[1]


class EngineProcess:
    """`python -m rollout.server --model MODEL_DIR --port P` as a subprocess (a real engine and server)."""

    def __init__(self, model_dir: Path, log_dir: Path, port: int | None = None) -> None:
        self.model_dir, self.port = model_dir, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"engine-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "EngineProcess":
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "rollout.server", "--model", str(self.model_dir), "--port", str(self.port),
               "--max-cache-tokens", "16384", "--max-running-requests", "256", "--log-level", "WARNING"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny")
    make_hf_checkpoint(d)
    return d


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs")
    procs = [EngineProcess(model_dir, log_dir).start() for _ in range(2)]

    async def wait():
        async with EngineClient([p.url for p in procs]) as client:
            await client.wait_healthy(timeout_s=120)

    try:
        asyncio.run(wait())
    except Exception:
        for p in procs:
            logger.error("engine log %s:\n%s", p.log, p.log.read_text()[-3000:])
        raise
    yield procs
    for p in procs:
        p.kill()


def greedy(n: int = 3) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def unique_prompt(i: int) -> list[int]:
    return [i % 97, (i // 97) % 97, 11]


def run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


# ---- routing ----------------------------------------------------------------------------------------------

def test_session_affinity_and_least_outstanding(engines):
    a, b = (e.url for e in engines)

    async def scenario():
        async with EngineClient([a, b], backoff_s=0.05) as client:
            # a session sticks to one engine
            urls = set()
            for _ in range(6):
                _, url = await client.request("/generate", {"input_ids": [1, 2], "sampling_params": greedy(1)},
                                              session_id="s1")
                urls.add(url)
            assert len(urls) == 1
            home = urls.pop()
            other = b if home == a else a

            # pin 6 long requests to `home` through the session, then send 6 short ones without a session:
            # least-outstanding routing sends every short one to the other engine
            long = [asyncio.create_task(client.request("/generate", {"input_ids": [3, i], "sampling_params": greedy(500)},
                                                       session_id="s1")) for i in range(6)]
            await asyncio.sleep(0.2)
            assert client.engines[home].outstanding == 6 and client.engines[other].outstanding == 0
            short = await asyncio.gather(*(client.request("/generate", {"input_ids": [4, i], "sampling_params": greedy(1)})
                                           for i in range(6)))
            assert {url for _, url in short} == {other}
            await client.broadcast("/abort_request", {"abort_all": True})
            finished = await asyncio.gather(*long)
            assert {url for _, url in finished} == {home}
            assert all(body["meta_info"]["finish_reason"]["type"] == "abort" for body, _ in finished)

            # with nothing outstanding, concurrent load splits evenly (ties alternate)
            before = {u: e.completed for u, e in client.engines.items()}
            await asyncio.gather(*(client.generate([5, i], greedy(2)) for i in range(40)))
            delta = [client.engines[u].completed - before[u] for u in (a, b)]
            assert sum(delta) == 40 and min(delta) >= 15, delta

    run(scenario())


def test_pick_prefers_least_outstanding_and_falls_back_when_all_dead():
    client = EngineClient(["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"])
    e1, e2, e3 = client.engines.values()
    e1.outstanding, e2.outstanding, e3.outstanding = 5, 2, 7
    assert client.pick() is e2
    assert client.pick(exclude={e2.url}) is e1
    e2.healthy = False
    assert client.pick() is e1
    assert client.pick("sess") is e1 and client.pick("sess") is e1  # sticks
    e1.healthy = False
    assert client.pick("sess") is e3  # its engine died: the session moves
    e3.healthy = False
    assert client.pick() is e2  # all dead: still try the least loaded rather than fail
    with pytest.raises(EngineUnavailableError):
        EngineClient([]).pick()


# ---- failures, timeouts, retries ----------------------------------------------------------------------------

def test_retry_goes_to_another_engine(engines):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def scenario():
        async with EngineClient([dead, engines[0].url], max_failures=1000, backoff_s=0.01) as client:
            results = await asyncio.gather(*(client.generate(unique_prompt(i), greedy(2)) for i in range(20)))
            assert all(r["meta_info"]["completion_tokens"] == 2 for r in results)
            assert client.engines[dead].failures >= 1 and client.engines[dead].completed == 0
            assert client.engines[engines[0].url].completed == 20

    run(scenario())


def test_backoff_then_give_up_and_mark_dead():
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]

    async def scenario():
        async with EngineClient(dead, max_retries=3, backoff_s=0.2, max_failures=2, probe_interval_s=60) as client:
            t0 = time.monotonic()
            with pytest.raises(EngineUnavailableError, match="failed after 4 attempts.*ClientConnectorError"):
                await client.generate([1, 2], greedy(1))
            elapsed = time.monotonic() - t0
            assert elapsed >= 0.8 * (0.2 + 0.4 + 0.8), elapsed  # exponential backoff between attempts
            assert all(not e.healthy for e in client.engines.values())
            assert [e.failures for e in client.engines.values()] == [2, 2]  # attempts alternate engines

    run(scenario())


def test_a_call_retrying_when_the_client_closes_ends_without_opening_a_pool():
    """A run shutting down closes its client while calls wait to retry: a retry must not reopen a connection pool
    that nobody closes (aiohttp's 'Unclosed connector' at exit), it ends with ClientClosedError."""
    dead = f"http://127.0.0.1:{free_port()}"

    async def scenario():
        client = EngineClient([dead], max_retries=3, backoff_s=0.5, max_failures=1, probe_interval_s=0.05)
        call = asyncio.ensure_future(client.generate([1, 2], greedy(1)))
        while client.engines[dead].failures == 0:
            await asyncio.sleep(0.01)
        await client.close()
        with pytest.raises(ClientClosedError, match="closed"):
            await call
        await asyncio.sleep(0.2)  # a probe would poll /health meanwhile
        assert client._http is None and client.engines[dead].probe.done()

    run(scenario())


def test_timeout_retries_and_aborts_the_stale_request(engines):
    url = engines[0].url

    async def scenario():
        async with EngineClient([url], timeout_s=0.5, max_retries=1, backoff_s=0.1) as client:
            t0 = time.monotonic()
            with pytest.raises(EngineUnavailableError, match="TimeoutError"):
                await client.generate([1, 2, 3], greedy(20000), rid="slow-one")
            assert 1.0 <= time.monotonic() - t0 < 10
            info = await client.get(url, "/get_server_info")
            assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0  # aborted, not left running
            # a request that fits the timeout still works on the same client
            assert (await client.generate([1, 2, 3], greedy(1)))["meta_info"]["completion_tokens"] == 1

    run(scenario())


def test_4xx_is_raised_at_once_not_retried(engines):
    async def scenario():
        async with EngineClient([e.url for e in engines], max_retries=5, backoff_s=1.0) as client:
            t0 = time.monotonic()
            with pytest.raises(EngineRequestError, match="sampling_params.top_p") as err:
                await client.generate([1, 2], {"top_p": 2.0})
            assert err.value.status == 400 and time.monotonic() - t0 < 1.0
            assert all(e.healthy and e.consecutive_failures == 0 for e in client.engines.values())

    run(scenario())


def test_malformed_responses_are_named():
    ok = {"text": "", "output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length", "length": 2},
                                                          "prompt_tokens": 3, "completion_tokens": 2,
                                                          "output_token_logprobs": [[-1.0, 5, None], [-0.5, 6, None]]}}
    validate_generate_response(ok, "http://e", return_logprob=True)
    cases = [
        ({**ok, "meta_info": {**ok["meta_info"], "finish_reason": "length"}}, "meta_info.finish_reason"),
        ({**ok, "meta_info": {**ok["meta_info"], "prompt_tokens": -1}}, "meta_info.prompt_tokens"),
        ({**ok, "meta_info": {**ok["meta_info"], "output_token_logprobs": [[-1.0, "5"], [-0.5, 6]]}},
         r"meta_info.output_token_logprobs\[0\]"),
        ({**ok, "meta_info": {**ok["meta_info"], "output_token_logprobs": [[-1.0, 5]]}}, "2 entries"),
        ({**ok, "output_ids": [5, 7]}, "equal to output_ids"),
        ({"text": "x"}, "meta_info"),
        ([], r"\(body\)"),
    ]
    for body, field in cases:
        with pytest.raises(MalformedResponseError, match=field):
            validate_generate_response(body, "http://e", return_logprob=True)


_ENTRY_PART = st.one_of(st.integers(-3, 3), st.floats(allow_nan=False), st.booleans(), st.text(max_size=2), st.none())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.lists(_ENTRY_PART, max_size=4), st.tuples(_ENTRY_PART, _ENTRY_PART), _ENTRY_PART),
                max_size=6))
def test_logprob_entries_are_judged_as_one_by_one(entries):
    """The check of output_token_logprobs in one pass names the same first bad entry as checking each in turn."""
    def bad_entry(e) -> bool:
        return (not isinstance(e, (list, tuple)) or len(e) < 2 or type(e[1]) is not int
                or type(e[0]) not in (int, float))

    first_bad = next((i for i, e in enumerate(entries) if bad_entry(e)), None)
    body = {"meta_info": {"finish_reason": {"type": "length"}, "prompt_tokens": 1, "completion_tokens": len(entries),
                          "output_token_logprobs": entries}}
    if first_bad is None:
        validate_generate_response(body, "http://e", return_logprob=True)
    else:
        with pytest.raises(MalformedResponseError, match=rf"output_token_logprobs\[{first_bad}\]"):
            validate_generate_response(body, "http://e", return_logprob=True)


def test_response_bodies_are_parsed_as_json_or_named():
    """A loopback server answering raw bodies: orjson's JSON, the standard library's NaN and Infinity literals
    (orjson refuses them; other servers may write them), an empty body as None, and a body that is not JSON named."""
    from aiohttp import web  # noqa: PLC0415

    bodies = {"/json": b'{"a": [1, -0.5, null]}', "/nan": b'{"lp": [NaN, -Infinity]}', "/empty": b" ",
              "/html": b"<html>busy</html>"}

    async def answer(request):
        return web.Response(body=bodies[request.path], content_type="application/json")

    async def scenario():
        app = web.Application()
        for path in bodies:
            app.router.add_post(path, answer)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with EngineClient([url], max_retries=0) as client:
                assert (await client.request("/json", {}))[0] == {"a": [1, -0.5, None]}
                lp = (await client.request("/nan", {}))[0]["lp"]
                assert lp[0] != lp[0] and lp[1] == float("-inf")
                assert (await client.request("/empty", {}))[0] is None
                with pytest.raises(EngineError, match="/html answered 200 with a body that is not JSON"):
                    await client.request("/html", {})
        finally:
            await runner.cleanup()

    run(scenario())


def test_broadcast_reaches_every_engine_and_names_failures(engines):
    dead = f"http://127.0.0.1:{free_port()}"

    async def scenario():
        urls = [e.url for e in engines]
        async with EngineClient(urls) as client:
            replies = await client.broadcast("/flush_cache")
            assert set(replies) == set(urls) and all(r.startswith("Cache flushed") for r in replies.values())
            assert all(r["status"] == "ok" for r in (await client.broadcast("/pause_generation", {"mode": "abort"})).values())
            await client.broadcast("/continue_generation", {})
            versions = await client.broadcast("/get_weight_version", method="GET")
            assert all(v == {"weight_version": "0"} for v in versions.values())
        async with EngineClient(urls + [dead]) as client:
            with pytest.raises(EngineError, match=f"failed on 1 of 3 engines: {dead}"):
                await client.broadcast("/flush_cache")

    run(scenario())


# ---- 1,000 concurrent requests, one engine killed mid-run, then revived -----------------------------------

def test_thousand_concurrent_requests_survive_an_engine_kill(engines, model_dir):
    a, b = engines
    n = 1000

    async def scenario():
        async with EngineClient([a.url, b.url], max_inflight_per_engine=128, timeout_s=60, max_retries=4,
                                backoff_s=0.2, max_failures=3, probe_interval_s=0.5) as client:
            done = 0
            killed_at = None

            async def one(i: int) -> dict:
                nonlocal done, killed_at
                result = await client.generate(unique_prompt(i), greedy(3), rid=f"req-{i}")
                done += 1
                if done == 300:
                    killed_at = time.monotonic()
                    b.kill()  # SIGKILL: in-flight requests on b lose their connection
                return result

            t0 = time.monotonic()
            results = await asyncio.gather(*(one(i) for i in range(n)))
            elapsed = time.monotonic() - t0
            stats = client.stats()
            logger.info("1000 requests in %.2fs (%.0f req/s); engine stats %s", elapsed, n / elapsed, stats)
            print(f"\n1000 requests through 2 engines, one killed after 300: {elapsed:.2f}s ({n / elapsed:.0f} req/s); {stats}")

            assert killed_at is not None
            ids = [r["meta_info"]["id"] for r in results]
            assert ids == [f"req-{i}" for i in range(n)]  # every request answered, in place, exactly once
            assert all(r["meta_info"]["completion_tokens"] == 3 and r["meta_info"]["prompt_tokens"] == 3 for r in results)
            assert stats[b.url]["failures"] >= 1 and not stats[b.url]["healthy"]
            assert stats[a.url]["completed"] + stats[b.url]["completed"] == n
            assert stats[b.url]["completed"] >= 50  # b carried load before it died

            # each answer belongs to its own prompt: greedy outputs equal a fresh request's on the survivor
            for i in range(0, n, 50):
                again = await client.generate(unique_prompt(i), greedy(3))
                assert again["output_ids"] == results[i]["output_ids"], i

            # restart b on the same port: the /health probe revives it and it takes load again
            b.start()
            deadline = time.monotonic() + 60
            while not client.engines[b.url].healthy:
                assert time.monotonic() < deadline, "killed engine was not revived by the health probe"
                await asyncio.sleep(0.2)
            before = client.engines[b.url].completed
            await asyncio.gather(*(client.generate(unique_prompt(i), greedy(1)) for i in range(40)))
            assert client.engines[b.url].completed - before >= 10

    run(scenario(), timeout=240)


def test_push_weights_to_every_engine(engines, model_dir):
    from slime_dsa.orchestrator.weight_sync.http import push_tensors
    from slime_dsa.checkpoint import read_state_dict

    state = read_state_dict(model_dir)  # the same weights under a new version: outputs must not change

    async def scenario():
        async with EngineClient([e.url for e in engines]) as client:
            await client.wait_healthy(60)
            before = await client.generate([7, 8, 9], greedy(3))
            running = asyncio.create_task(client.generate([1, 2, 3], greedy(500)))
            await asyncio.sleep(0.3)
            await push_tensors(client, state, version=1, pause_mode="retract", bucket_bytes=100_000)
            versions = await client.broadcast("/get_weight_version", method="GET")
            assert all(v == {"weight_version": "1"} for v in versions.values())
            finished = await running  # retracted during the update, then finished on the new version
            assert finished["meta_info"]["finish_reason"]["type"] == "length"
            token_versions = finished["meta_info"]["output_token_versions"]
            assert token_versions[0] == 0 and token_versions[-1] == 1 and token_versions == sorted(token_versions)
            after = await client.generate([7, 8, 9], greedy(3))
            assert after["output_ids"] == before["output_ids"] and after["meta_info"]["weight_version"] == "1"

    run(scenario())


# ---- Ray actor --------------------------------------------------------------------------------------------

def test_engine_actor_serves_over_http(ray_cluster, model_dir):
    from rollout.actors import create_engine_actors, start_engine_actors

    actors = create_engine_actors(1, model_dir=str(model_dir), num_cpus_per_engine=1,
                                  engine_kwargs={"max_cache_tokens": 4096})
    try:
        urls = start_engine_actors(actors, timeout_s=120)
        assert urls[0].startswith("http://127.0.0.1:")

        async def scenario():
            async with EngineClient(urls) as client:
                out = await client.generate([1, 2, 3], greedy(2))
                assert out["meta_info"]["completion_tokens"] == 2

        run(scenario())
        ray_cluster.get(actors[0].stop.remote())
    finally:
        for actor in actors:
            ray_cluster.kill(actor)
