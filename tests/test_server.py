"""The SGLang-protocol HTTP server over the real embedded engine, over real HTTP on 127.0.0.1.

A tiny random GLM-MoE-DSA checkpoint (transformers' own, saved with our tokenizer) is served by an
EmbeddedServer running in a background event loop; tests talk to it with `requests` (and aiohttp where they
need requests in flight at once). Reference outputs for weight updates come from transformers.
"""

from __future__ import annotations

import asyncio
import base64
import json
import pickle
import threading
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import requests
import torch

from rollout.client import decode_indexer_topk
from rollout.server.launch import EmbeddedServer, load_engine
from rollout.server.openai_api import parse_tool_calls, split_reasoning
from slime_dsa.weights.safetensors_b64 import encode_named_tensors, tensor_update_payloads
from tests.hf_reference import make_hf_checkpoint

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY = 64 * 1024
MAX_PROMPT = 64


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Three checkpoints of one architecture (different seeds), each with the GLM-style tokenizer."""
    from slime_dsa.data.tokenizer import MODEL_VOCAB_SIZE, build_tokenizer, save_tokenizer

    eos = build_tokenizer().eos_token_id
    dirs = {}
    for seed in (0, 1, 2):
        d = tmp_path_factory.mktemp(f"model{seed}")
        make_hf_checkpoint(d, seed=seed, vocab_size=MODEL_VOCAB_SIZE, eos_token_id=eos)
        save_tokenizer(d)
        dirs[seed] = d
    return dirs


class ServerThread:
    """An EmbeddedServer on 127.0.0.1 in its own event loop thread, so tests can use blocking HTTP."""

    def __init__(self, model_dir: Path, **app_kwargs) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        engine, tokenizer = load_engine(model_dir, max_cache_tokens=8192, max_running_requests=64)
        self.server = self._run(EmbeddedServer.start(engine, tokenizer, model_path=str(model_dir), **app_kwargs))
        self.url = self.server.url

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def stop(self) -> None:
        self._run(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@contextmanager
def serving(model_dir: Path, **app_kwargs):
    srv = ServerThread(model_dir, **app_kwargs)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server(checkpoints):
    with serving(checkpoints[0], api_key=API_KEY, max_body_bytes=MAX_BODY, max_prompt_tokens=MAX_PROMPT) as srv:
        yield srv


def post(srv, path, body=None, *, headers=AUTH, data=None, timeout=60):
    # every POST is JSON, an empty one {} (the server refuses a POST without Content-Type: application/json)
    r = requests.post(srv.url + path, json=({} if body is None else body) if data is None else None, data=data,
                      headers=headers, timeout=timeout)
    return r.status_code, _body(r)


def get(srv, path, *, headers=AUTH):
    r = requests.get(srv.url + path, headers=headers, timeout=60)
    return r.status_code, _body(r)


def _body(r):
    try:
        return r.json()
    except ValueError:
        return r.text


def greedy(max_new_tokens=4, **extra):
    return {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True, **extra}


PROMPT = list(range(10, 50))  # 40 tokens: two full prefix-cache blocks of 16


def assert_still_serving(srv):
    status, body = post(srv, "/generate", {"input_ids": [1, 2, 3], "sampling_params": greedy(2)})
    assert status == 200 and body["meta_info"]["completion_tokens"] == 2


# ---- /generate ----------------------------------------------------------------------------------------------

def test_generate_input_ids_response_shape(server):
    status, body = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": greedy(5), "return_logprob": True,
                                              "rid": "my-rid"})
    assert status == 200
    meta = body["meta_info"]
    assert meta["id"] == "my-rid"
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 5
    assert meta["weight_version"] == "0" and meta["output_token_versions"] == [0] * 5
    assert isinstance(meta["cached_tokens"], int) and meta["e2e_latency"] > 0
    lps = meta["output_token_logprobs"]
    assert [e[1] for e in lps] == body["output_ids"] and all(e[2] is None for e in lps)
    assert all(isinstance(e[0], float) and e[0] <= 0 for e in lps)
    assert isinstance(body["text"], str)


def test_generate_text_and_text_in_logprobs(server):
    status, body = post(server, "/generate", {"text": "Compute 12 + 34", "sampling_params": greedy(3),
                                              "return_logprob": True, "return_text_in_logprobs": True})
    assert status == 200
    assert body["meta_info"]["prompt_tokens"] == len(server.server.runner.app[_state_key()].tokenizer.encode("Compute 12 + 34"))
    assert all(isinstance(e[2], str) for e in body["meta_info"]["output_token_logprobs"])


def _state_key():
    from rollout.server.state import STATE

    return STATE


def test_batch_in_request_order(server):
    prompts = [[5, 6, 7], list(range(20, 31)), [9]]
    status, body = post(server, "/generate", {"input_ids": prompts, "rid": ["a", "b", "c"],
                                              "sampling_params": [greedy(2), greedy(3), greedy(1)]})
    assert status == 200 and isinstance(body, list) and len(body) == 3
    assert [b["meta_info"]["id"] for b in body] == ["a", "b", "c"]
    assert [b["meta_info"]["prompt_tokens"] for b in body] == [3, 11, 1]
    assert [b["meta_info"]["completion_tokens"] for b in body] == [2, 3, 1]
    # the same prompt alone gives the same greedy tokens as inside the batch
    _, alone = post(server, "/generate", {"input_ids": prompts[1], "sampling_params": greedy(3)})
    assert alone["output_ids"] == body[1]["output_ids"]
    status, texts = post(server, "/generate", {"text": ["one", "two"], "sampling_params": greedy(2)})
    assert status == 200 and len(texts) == 2


def test_n_expands_into_n_samples(server):
    status, body = post(server, "/generate", {"input_ids": [[1, 2, 3], [4, 5]], "rid": ["p", "q"],
                                              "sampling_params": {"max_new_tokens": 6, "n": 3, "sampling_seed": 7,
                                                                  "ignore_eos": True}})
    assert status == 200 and len(body) == 6
    assert [b["meta_info"]["id"] for b in body] == ["p_0", "p_1", "p_2", "q_0", "q_1", "q_2"]
    assert [b["meta_info"]["prompt_tokens"] for b in body] == [3, 3, 3, 2, 2, 2]
    # each sample has its own seed (sampling_seed + j): the samples of one prompt differ
    assert len({tuple(b["output_ids"]) for b in body[:3]}) > 1
    _, again = post(server, "/generate", {"input_ids": [[1, 2, 3], [4, 5]],
                                          "sampling_params": {"max_new_tokens": 6, "n": 3, "sampling_seed": 7,
                                                              "ignore_eos": True}})
    assert [b["output_ids"] for b in again] == [b["output_ids"] for b in body]  # seeded: reproducible


def _sse(srv, body):
    r = requests.post(srv.url + "/generate", json=body, headers=AUTH, stream=True, timeout=60)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = [line.decode() for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1]]


def test_stream_is_cumulative_and_ends_with_done(server):
    body = {"input_ids": PROMPT, "sampling_params": greedy(6), "return_logprob": True, "stream": True}
    chunks = _sse(server, body)
    assert len(chunks) >= 2
    for prev, nxt in zip(chunks, chunks[1:]):
        assert nxt["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert prev["meta_info"]["finish_reason"] is None
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    assert len(final["meta_info"]["output_token_logprobs"]) == 6
    _, whole = post(server, "/generate", {**body, "stream": False})
    assert whole["output_ids"] == final["output_ids"]


def test_stream_batch_carries_index(server):
    chunks = _sse(server, {"input_ids": [[1, 2], [3, 4, 5]], "sampling_params": greedy(3), "stream": True})
    finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"]}
    assert sorted(finals) == [0, 1] and finals[1]["meta_info"]["prompt_tokens"] == 3


def test_indexer_topk_is_base64_int32_with_shape(server):
    status, body = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": greedy(3),
                                              "return_indexer_topk": True})
    assert status == 200
    meta = body["meta_info"]
    _, info = get(server, "/get_model_info")
    assert meta["indexer_topk_shape"] == [3, info["n_full_layers"], info["index_topk"]]
    topk = decode_indexer_topk(meta)
    assert topk.dtype == np.int32 and topk.shape == (3, info["n_full_layers"], info["index_topk"])
    assert topk.min() >= -1 and topk.max() < len(PROMPT) + 3
    assert meta["indexer_topk_start"] == len(PROMPT) - 1  # one row per output token
    assert "indexer_topk" not in post(server, "/generate", {"input_ids": PROMPT, "sampling_params": greedy(1)})[1]["meta_info"]
    # Prompt rows need an engine that keeps them (serve --keep-indexer-topk; tests/test_index_replay_prompt.py).
    for value, needle in ((0, "keep_indexer_topk"), (-2, "indexer_topk_start_len"), ("0", "indexer_topk_start_len")):
        status, body = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": greedy(1),
                                                  "return_indexer_topk": True, "indexer_topk_start_len": value})
        assert status == 400 and needle in body["error"]["message"]


def test_stop_token_trims_text_but_keeps_the_id(server):
    _, first = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": greedy(3)})
    stop_id = first["output_ids"][1]
    _, body = post(server, "/generate", {"input_ids": PROMPT, "return_logprob": True,
                                         "sampling_params": greedy(3, stop_token_ids=[stop_id], ignore_eos=False)})
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert body["output_ids"] == first["output_ids"][:2]
    assert body["meta_info"]["output_token_logprobs"][-1][1] == stop_id
    # SGLang's ignore_eos turns off stop_token_ids too.
    _, body = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": greedy(3, stop_token_ids=[stop_id])})
    assert body["output_ids"] == first["output_ids"] and body["meta_info"]["finish_reason"]["type"] == "length"


def test_max_new_tokens_wins_over_min_new_tokens_and_the_context(server):
    _, body = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": greedy(4, min_new_tokens=40)})
    assert len(body["output_ids"]) == 4 and body["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    context = 512  # the tiny checkpoint's max_position_embeddings
    _, body = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": greedy(context, min_new_tokens=context)})
    room = context - len(PROMPT)
    assert len(body["output_ids"]) == room and body["meta_info"]["finish_reason"] == {"type": "length", "length": room}
    assert_still_serving(server)


# ---- bad requests -----------------------------------------------------------------------------------------

BAD_GENERATE = [
    ({}, "exactly one of text and input_ids"),
    ({"text": "hi", "input_ids": [1, 2]}, "not both"),
    ({"input_ids": "abc"}, "input_ids"),
    ({"input_ids": [1, "2"]}, "input_ids"),
    ({"input_ids": [1, 999]}, "input_ids holds 999"),
    ({"input_ids": list(range(MAX_PROMPT + 1))}, "limit is 64"),
    ({"input_ids": [1], "sampling_params": "x"}, "sampling_params must be an object"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "5"}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"input_ids": [1], "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
    ({"input_ids": [1], "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"input_ids": [1], "sampling_params": {"n": True}}, "sampling_params.n must be a positive integer"),
    ({"input_ids": [[1], [2]], "sampling_params": [{"n": 2}, {"n": 3}]}, "sampling_params.n must be the same"),
    ({"input_ids": [1], "sampling_params": {"n": 2, "sampling_seed": 2**64 - 1}},
     "sampling_params.sampling_seed 18446744073709551615 with n=2"),
    ({"input_ids": [[1], [2]], "sampling_params": [{"n": 2}, {"n": 2, "sampling_seed": 2**64 - 1}]},
     "sampling_params[1].sampling_seed"),
    ({"input_ids": [1], "sampling_params": {"foo": 1}}, "sampling_params.foo is not a known"),
    ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, "sampling_params.frequency_penalty"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}, {}, {}]}, "sampling_params has 3 entries"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}, {"top_k": -5}]}, "sampling_params[1].top_k"),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob must be a boolean"),
    ({"input_ids": [1], "return_logprob": True, "logprob_start_len": 0}, "logprob_start_len"),
    ({"input_ids": [1], "top_logprobs_num": 5}, "top_logprobs_num"),
    ({"input_ids": [1], "rid": 5}, "rid must be a non-empty string"),
    ({"text": 5}, "text must be a string"),
    ({"input_ids": [1], "sampling_params": {"n": 5000}}, "the limit is 4096"),
    ({"input_ids": [[1], [2]], "rid": ["x", "x"]}, "rid 'x' is already in use"),
]


@pytest.mark.parametrize("body, message", BAD_GENERATE, ids=[m for _, m in BAD_GENERATE])
def test_bad_generate_gets_400_naming_the_field(server, body, message):
    status, reply = post(server, "/generate", body)
    assert status == 400, reply
    assert message in reply["error"]["message"]
    assert_still_serving(server)


def test_bad_json_and_big_body_and_non_object(server):
    status, reply = post(server, "/generate", data=b"{not json", headers={**AUTH, "Content-Type": "application/json"})
    assert status == 400 and "not valid JSON" in reply["error"]["message"]
    big = json.dumps({"input_ids": [1] * (MAX_BODY // 2)}).encode()
    status, reply = post(server, "/generate", data=big, headers={**AUTH, "Content-Type": "application/json"})
    assert status == 413 and "limit is 65536" in reply["error"]["message"] and "max_body_bytes" in reply["error"]["message"]
    status, reply = post(server, "/generate", [1, 2])
    assert status == 400 and "JSON object" in reply["error"]["message"]
    assert_still_serving(server)


def test_api_key_is_enforced_but_health_is_public(server):
    status, reply = post(server, "/generate", {"input_ids": [1]}, headers={})
    assert status == 401 and "Authorization: Bearer" in reply["error"]["message"]
    status, _ = post(server, "/generate", {"input_ids": [1]}, headers={"Authorization": "Bearer wrong"})
    assert status == 401
    assert get(server, "/get_model_info", headers={})[0] == 401
    assert get(server, "/health", headers={})[0] == 200
    assert_still_serving(server)


def test_unknown_path_is_json_404(server):
    status, reply = get(server, "/no_such_endpoint")
    assert status == 404 and "error" in reply


# ---- control endpoints ------------------------------------------------------------------------------------

def test_health_and_info_endpoints(server, checkpoints):
    assert get(server, "/health") == (200, "")
    assert get(server, "/health_generate") == (200, "")
    for path in ("/get_model_info", "/model_info"):
        status, info = get(server, path)
        assert status == 200 and info["model_path"] == str(checkpoints[0]) and info["is_generation"] is True
        assert info["weight_version"] == "0" and info["tokenizer_path"] == str(checkpoints[0])
    for path in ("/get_server_info", "/server_info"):
        status, info = get(server, path)
        assert status == 200 and info["max_prompt_tokens"] == MAX_PROMPT and info["weight_version"] == "0"
        assert "version" in info and info["max_body_bytes"] == MAX_BODY
    assert get(server, "/get_weight_version") == (200, {"weight_version": "0"})


def test_distributed_update_endpoints_are_refused_clearly(server):
    for path in ("/init_weights_update_group", "/update_weights_from_distributed"):
        status, reply = post(server, path, {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]})
        assert status == 400 and reply["success"] is False
        assert "not supported by the embedded engine" in reply["message"]
        assert "/update_weights_from_tensor" in reply["message"]


async def _long_request(srv, rid, max_new_tokens=400):
    async with aiohttp.ClientSession(headers=AUTH) as http:
        async with http.post(srv.url + "/generate", json={"input_ids": [1, 2, 3], "rid": rid,
                                                          "sampling_params": greedy(max_new_tokens)}) as r:
            return r.status, await r.json()


async def _wait_running(srv, n=1):
    for _ in range(200):
        _, info = await asyncio.to_thread(get, srv, "/get_server_info")
        if info["num_running_reqs"] + info["num_waiting_reqs"] >= n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("request never started")


def test_flush_refused_while_running_then_abort_request(server):
    async def scenario():
        task = asyncio.create_task(_long_request(server, "long-1"))
        await _wait_running(server)
        status, text = await asyncio.to_thread(post, server, "/flush_cache")
        assert status == 400 and "not flushed" in text.lower()
        assert (await asyncio.to_thread(post, server, "/abort_request", {"rid": "long-1"}))[0] == 200
        status, body = await asyncio.wait_for(task, 30)
        assert status == 200 and body["meta_info"]["finish_reason"]["type"] == "abort"
        assert body["meta_info"]["completion_tokens"] < 400

    asyncio.run(scenario())
    status, text = post(server, "/flush_cache")
    assert status == 200 and text.startswith("Cache flushed")
    assert get(server, "/flush_cache")[0] == 405  # POST only: a web page can make a browser GET any URL


def test_pause_abort_and_continue(server):
    async def scenario():
        task = asyncio.create_task(_long_request(server, "long-2"))
        await _wait_running(server)
        status, reply = await asyncio.to_thread(post, server, "/pause_generation", {"mode": "abort"})
        assert status == 200 and reply["status"] == "ok"
        _, body = await asyncio.wait_for(task, 30)
        assert body["meta_info"]["finish_reason"]["type"] == "abort"
        status, reply = await asyncio.to_thread(post, server, "/continue_generation", {})
        assert status == 200 and reply["status"] == "ok"

    asyncio.run(scenario())
    assert post(server, "/pause_generation", {"mode": "sideways"})[0] == 400
    assert_still_serving(server)


def test_pause_in_place_holds_requests_until_continue(server):
    async def scenario():
        assert (await asyncio.to_thread(post, server, "/pause_generation", {"mode": "in_place"}))[0] == 200
        assert (await asyncio.to_thread(get, server, "/health_generate"))[0] == 200  # paused on purpose: healthy
        task = asyncio.create_task(_long_request(server, "held", max_new_tokens=3))
        await asyncio.sleep(0.5)
        assert not task.done()
        assert (await asyncio.to_thread(post, server, "/continue_generation"))[0] == 200
        status, body = await asyncio.wait_for(task, 30)
        assert status == 200 and body["meta_info"]["finish_reason"]["type"] == "length"

    asyncio.run(scenario())


def test_client_disconnect_aborts_the_request(server):
    async def scenario():
        generated = get(server, "/get_server_info")[1]["stats_generated_tokens"]
        async with aiohttp.ClientSession(headers=AUTH) as http:
            with pytest.raises(asyncio.TimeoutError):
                await http.post(server.url + "/generate", json={"input_ids": [1, 2], "sampling_params": greedy(5000)},
                                timeout=aiohttp.ClientTimeout(total=0.5))
        for _ in range(100):
            _, info = await asyncio.to_thread(get, server, "/get_server_info")
            if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0:
                # it ended early (the context allows 510 new tokens): aborted, not run to its end
                assert info["stats_generated_tokens"] - generated < 500
                return
            await asyncio.sleep(0.05)
        raise AssertionError("request kept running after its client went away")

    asyncio.run(scenario())


# ---- weight updates ---------------------------------------------------------------------------------------

def hf_greedy(model_dir: Path, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs from transformers' GlmMoeDsaForCausalLM (eager, float32, no cache)."""
    from transformers import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(model_dir, attn_implementation="eager").float().eval()
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            logp = torch.log_softmax(logits, -1)
            tok = int(logp.argmax())
            ids.append(tok)
            lps.append(float(logp[tok]))
    return ids[len(prompt):], lps


def _check_matches(body, ref_ids, ref_lps, version):
    assert body["output_ids"] == ref_ids
    got = [e[0] for e in body["meta_info"]["output_token_logprobs"]]
    assert np.allclose(got, ref_lps, atol=1e-4), (got, ref_lps)
    assert body["meta_info"]["weight_version"] == version
    assert set(body["meta_info"]["output_token_versions"]) == {int(version)}


def test_weight_updates_from_tensor_and_disk(checkpoints):
    from slime_dsa.checkpoint import read_state_dict

    n = 6
    with serving(checkpoints[0], weight_dirs=[str(checkpoints[2].parent)]) as srv:
        body = {"input_ids": PROMPT, "sampling_params": greedy(n), "return_logprob": True}
        _, before = post(srv, "/generate", body, headers={})
        _check_matches(before, *hf_greedy(checkpoints[0], PROMPT, n), "0")
        _, cached = post(srv, "/generate", body, headers={})
        assert cached["meta_info"]["cached_tokens"] >= 32  # the prompt's two full blocks came from the cache

        # SGLang's pickle format is refused, whatever load_format says, and nothing changes
        pickled = base64.b64encode(pickle.dumps({"w": torch.zeros(1)})).decode()
        for fmt in (None, "direct", "flattened_bucket", "safetensors_b64"):
            status, reply = post(srv, "/update_weights_from_tensor",
                                 {"serialized_named_tensors": [pickled], "load_format": fmt}, headers={})
            assert status == 400 and "never" in reply["error"]["message"] and "pickle" in reply["error"]["message"]
        status, reply = post(srv, "/update_weights_from_tensor", {"serialized_named_tensors": ["%%%"],
                                                                   "load_format": "safetensors_b64"}, headers={})
        assert status == 400 and "base64" in reply["error"]["message"]
        bad = encode_named_tensors({"model.embed_tokens.weight": torch.zeros(3, 3)})
        status, reply = post(srv, "/update_weights_from_tensor", {"serialized_named_tensors": [bad],
                                                                   "load_format": "safetensors_b64"}, headers={})
        assert status == 400 and reply["success"] is False and "model.embed_tokens.weight" in reply["message"]
        assert get(srv, "/get_weight_version", headers={})[1] == {"weight_version": "0"}

        # from tensor, in several buckets: the version changes once, with the last
        new_state = read_state_dict(checkpoints[1])
        payloads = tensor_update_payloads(new_state, weight_version="1", bucket_bytes=200_000)
        assert len(payloads) > 1
        for payload in payloads:
            status, reply = post(srv, "/update_weights_from_tensor", payload, headers={})
            assert status == 200 and reply["success"] is True, reply
        assert get(srv, "/get_weight_version", headers={})[1] == {"weight_version": "1"}
        _, after = post(srv, "/generate", body, headers={})
        assert after["meta_info"]["cached_tokens"] == 0  # flushed: no prefix computed under the old weights
        _check_matches(after, *hf_greedy(checkpoints[1], PROMPT, n), "1")

        # from disk
        status, reply = post(srv, "/update_weights_from_disk", {"model_path": str(checkpoints[2]), "weight_version": "2"},
                             headers={})
        assert status == 200 and reply["success"] is True
        _, after = post(srv, "/generate", body, headers={})
        assert after["meta_info"]["cached_tokens"] == 0
        _check_matches(after, *hf_greedy(checkpoints[2], PROMPT, n), "2")
        assert get(srv, "/get_model_info", headers={})[1]["weight_version"] == "2"

        status, reply = post(srv, "/update_weights_from_disk", {"model_path": str(checkpoints[2].parent / "nope")},
                             headers={})
        assert status == 400 and reply["success"] is False and "nope" in reply["message"]
        status, reply = post(srv, "/update_weights_from_disk", {}, headers={})
        assert status == 400 and "model_path" in reply["error"]["message"]
        assert get(srv, "/get_weight_version", headers={})[1] == {"weight_version": "2"}
        assert_still_serving(srv)


# ---- OpenAI-compatible ------------------------------------------------------------------------------------

def test_v1_completions(server):
    status, body = post(server, "/v1/completions", {"model": "x", "prompt": "Compute 1 + 2", "max_tokens": 4,
                                                    "temperature": 0, "ignore_eos": True, "logprobs": 1})
    assert status == 200 and body["object"] == "text_completion"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["logprobs"]["token_logprobs"]) == 4
    assert body["usage"]["completion_tokens"] == 4
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 4
    # token-id prompts, several prompts, n samples each; default max_tokens is 16
    status, body = post(server, "/v1/completions", {"prompt": [[1, 2, 3], [4, 5]], "n": 2, "ignore_eos": True})
    assert status == 200 and len(body["choices"]) == 4
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 64, "total_tokens": 69}
    # a stop token maps to finish_reason "stop"
    _, first = post(server, "/generate", {"input_ids": [1, 2, 3], "sampling_params": greedy(2)})
    _, body = post(server, "/v1/completions", {"prompt": [1, 2, 3], "temperature": 0, "max_tokens": 5,
                                               "stop_token_ids": [first["output_ids"][0]]})
    assert body["choices"][0]["finish_reason"] == "stop"
    assert post(server, "/v1/completions", {"prompt": "x", "stream": True})[0] == 400
    assert post(server, "/v1/completions", {"max_tokens": 2})[1]["error"]["message"] == "prompt is required"
    assert "temperature" in post(server, "/v1/completions", {"prompt": "x", "temperature": "hot"})[1]["error"]["message"]


def test_v1_chat_completions(server):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2 + 3?"}]
    status, body = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 5, "temperature": 0,
                                                         "ignore_eos": True, "logprobs": True})
    assert status == 200 and body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["content"]) == 5
    # the prompt is the chat template of the tokenizer saved with the model
    tok = server.server.runner.app[_state_key()].tokenizer
    template_ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(template_ids)
    # input_ids bypass the template and give the same tokens as /generate
    status, bypass = post(server, "/v1/chat/completions", {"input_ids": template_ids, "max_tokens": 5, "temperature": 0,
                                                           "ignore_eos": True, "separate_reasoning": False})
    _, native = post(server, "/generate", {"input_ids": template_ids, "sampling_params": greedy(5)})
    assert bypass["choices"][0]["message"]["content"] == native["text"]
    # tools render through the template; an assistant turn's tool_calls take a JSON-string arguments
    history = messages + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "content": "5"}]
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    status, reply = post(server, "/v1/chat/completions", {"messages": history, "tools": tools, "max_tokens": 2})
    assert status == 400 and "messages has" in reply["error"]["message"] and "limit is 64" in reply["error"]["message"]
    with serving(Path(server.server.runner.app[_state_key()].model_path)) as roomy:  # default prompt limit
        status, reply = post(roomy, "/v1/chat/completions", {"messages": history, "tools": tools, "max_tokens": 2})
        assert status == 200, reply
    status, reply = post(server, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]})
    assert status == 400 and "chat template" in reply["error"]["message"]
    assert post(server, "/v1/chat/completions", {"messages": []})[0] == 400
    assert post(server, "/v1/chat/completions", {"messages": messages, "top_logprobs": 3})[0] == 400
    assert get(server, "/v1/models")[1]["data"][0]["object"] == "model"


def test_v1_chat_content_parts_other_than_text_are_refused(server):
    """The chat template renders text parts only: an image_url part was dropped and the model answered an empty user
    turn with 200."""
    text = [{"type": "text", "text": "What is 2 + 3?"}]
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    assert post(server, "/v1/chat/completions", body)[0] == 200
    for part, named in (({"type": "image_url", "image_url": {"url": "http://x/cat.png"}}, "type 'image_url'"),
                        ({"type": "text", "text": 5}, "text must be a string"), ("just a string", "must be an object")):
        status, reply = post(server, "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": [*text, part]}], "max_tokens": 1})
        assert status == 400 and reply["error"]["message"].startswith("messages[0].content[1]"), reply
        assert named in reply["error"]["message"], reply


@pytest.mark.parametrize("route, prompt", [("/v1/completions", {"prompt": "x"}),
                                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})])
def test_v1_errors_name_the_field_as_the_request_spells_it(server, route, prompt):
    """A bad max_tokens was refused as 'sampling_params.max_new_tokens', a field the OpenAI request does not have."""
    for fields, named in (({"max_tokens": -1}, "max_tokens must be"), ({"seed": 1.5}, "seed must be"),
                          ({"max_completion_tokens": "8"}, "max_completion_tokens must be"),
                          ({"temperature": -1}, "temperature must be")):
        status, reply = post(server, route, {**prompt, **fields})
        assert status == 400 and reply["error"]["message"].startswith(named), reply


def test_reasoning_and_tool_call_parsers():
    assert split_reasoning("<think>add them</think>The answer is 5") == ("add them", "The answer is 5")
    assert split_reasoning("<think>still thinking") == ("still thinking", "")
    assert split_reasoning("plain") == (None, "plain")
    content, calls = parse_tool_calls('Let me compute.<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>')
    assert content == "Let me compute." and calls[0]["function"] == {"name": "calc", "arguments": '{"x": 1}'}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    _, calls = parse_tool_calls("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                                "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>")
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert parse_tool_calls("no calls here") == ("no calls here", [])


def test_cli_generate_with_a_model_directory(checkpoints, tmp_path, capsys):
    from slime_dsa.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    out = tmp_path / "out.jsonl"
    code = main(["generate", "--model", str(checkpoints[0]), "--prompt", "Compute 1 + 2", "--input", str(prompts),
                 "--output", str(out), "--max-new-tokens", "3", "--temperature", "0", "--device", "cpu"])
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [sorted(set(r) & {"prompt", "input_ids", "messages"}) for r in rows] == [["prompt"], ["input_ids"], ["messages"]]
    assert rows[0]["output"]["meta_info"]["completion_tokens"] <= 3 and rows[1]["output"]["meta_info"]["prompt_tokens"] == 3
    assert rows[2]["choices"][0]["message"]["role"] == "assistant"
    assert main(["generate", "--model", str(checkpoints[0])]) == 2
    assert "no prompts" in capsys.readouterr().err


# ---- memory release for colocated training ------------------------------------------------------------------

def test_release_and_resume_memory_keep_outputs(server):
    request = {"input_ids": PROMPT, "sampling_params": greedy(6), "return_logprob": True}
    _, before = post(server, "/generate", request)
    assert post(server, "/pause_generation", {"mode": "abort"})[0] == 200
    assert post(server, "/release_memory_occupation", {"tags": None}) == (200, None)
    status, body = post(server, "/release_memory_occupation", {"tags": ["gpu"]})
    assert status == 400 and "tags" in body["error"]["message"]
    assert post(server, "/resume_memory_occupation", {}) == (200, None)
    assert post(server, "/continue_generation", {})[0] == 200
    _, after = post(server, "/generate", request)
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]


def test_response_helpers_equal_their_plain_forms():
    """protocol's fast paths (log-prob lists, base64 from the array's buffer, the collector paused) change nothing."""
    import gc

    from rollout.server import protocol

    rows = np.arange(-1, 5 * 2 * 7 - 1, dtype=np.int32).reshape(5, 2, 7)[1::2]  # a strided view: copied first
    text, shape = protocol.encode_int32(rows)
    assert text == base64.b64encode(np.ascontiguousarray(rows, dtype="<i4").tobytes()).decode() and shape == [2, 2, 7]
    assert protocol.encode_int32(np.zeros((0, 2, 7), dtype=np.int32)) == ("", [0, 2, 7])
    assert protocol.token_logprobs([-0.5, -1.25], [3, 9]) == [[-0.5, 3, None], [-1.25, 9, None]]
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        with protocol.collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled
    gc.enable()


def test_generate_bodies_are_orjson_unless_a_log_prob_is_not_finite():
    """The /generate body is orjson's (SGLang's server writes it so too); one with a non-finite log-prob keeps the
    standard library's NaN / Infinity, which orjson would write as null and a client refuse."""
    from rollout.engine.types import GenerateOutput
    from rollout.server.protocol import response_json

    def out(logprobs, inputs=None):
        return GenerateOutput(rid="r", output_ids=[3] * len(logprobs), output_token_logprobs=logprobs,
                              output_token_versions=[0] * len(logprobs), finish_reason=None, prompt_tokens=2,
                              cached_tokens=0, weight_version="0", input_token_logprobs=inputs)

    body = {"meta_info": {"output_token_logprobs": [[-0.25, 3, None], [-1e-9, 3, None]], "e2e_latency": 0.5}}
    fine = [out([-0.25, -1e-9], inputs=[None, -2.5])]
    assert json.loads(response_json(body, fine)) == body and b" " not in response_json(body, fine)  # orjson: compact
    for bad in ([-0.25, float("-inf")], [float("nan")]):
        text = response_json({"x": bad}, [out(bad)])
        assert text == json.dumps({"x": bad}).encode() and (b"Infinity" in text or b"NaN" in text)
    assert b"NaN" in response_json({"x": [float("nan")]}, [out([-1.0], inputs=[None, float("nan")])])


def test_the_engine_uses_the_runs_tokenizer_path(checkpoints, tmp_path, engine_actor_kwargs):
    """An embedded engine detokenises and matches stop strings with the run's model.tokenizer_path, as the driver
    and trainers do: it loaded the tokenizer saved with the model whatever the recipe said."""
    from transformers import AutoTokenizer

    from slime_dsa.config import RecipeConfig
    from slime_dsa.orchestrator import setup

    own = AutoTokenizer.from_pretrained(str(checkpoints[0]))
    other = tmp_path / "tokenizer"
    AutoTokenizer.from_pretrained(str(checkpoints[0]), model_max_length=own.model_max_length + 7).save_pretrained(other)
    engine, tokenizer = load_engine(checkpoints[0], max_cache_tokens=1024, max_running_requests=4,
                                    tokenizer_path=str(other))
    assert tokenizer.model_max_length == own.model_max_length + 7
    assert engine.model_info()["tokenizer_path"] == str(other)
    recipe = RecipeConfig.model_validate({"model": {"path": str(checkpoints[0]), "tokenizer_path": str(other)},
                                          "data": {"tasks": [{"kind": "arithmetic"}]}})
    setup.create_engines(recipe, checkpoints[0], use_async=False, access=None, count=1)
    assert engine_actor_kwargs["engine_kwargs"]["tokenizer_path"] == str(other)
