"""HTTP fuzzing of every route of the embedded server (hypothesis, property-based): random JSON bodies, bodies shaped
like each route's own fields with random values, and raw bytes. Every answer is a 2xx or a 4xx, never a 5xx or a
hang, and afterwards the server still answers /health and gives the same greedy /generate as before.

A real EmbeddedServer over a tiny model on 127.0.0.1; after each example the engine is continued and its memory
resumed (a fuzzed pause or release is a legitimate request, and the next example must not wait behind it).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.hf_reference import make_hf_checkpoint
from tests.test_server import serving

pytestmark = pytest.mark.slow

TIMEOUT_S = 30
GREEDY = {"input_ids": list(range(3, 19)), "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                "ignore_eos": True}}
# Field names each route reads, so that fuzzed bodies reach its checks and not only "unknown field".
FIELDS = {
    "/generate": ["text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len", "stream",
                  "return_text_in_logprobs", "session_id", "session_params", "return_indexer_topk",
                  "indexer_topk_start_len", "top_logprobs_num", "lora_path"],
    "/v1/completions": ["prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "logprobs", "echo",
                        "stream", "best_of", "suffix", "model", "min_tokens"],
    "/v1/chat/completions": ["messages", "tools", "tool_choice", "input_ids", "chat_template_kwargs", "max_tokens",
                             "logprobs", "top_logprobs", "separate_reasoning", "response_format", "n", "seed"],
    "/update_weights_from_tensor": ["serialized_named_tensors", "load_format", "flush_cache", "weight_version",
                                    "abort_all_requests"],
    "/update_weights_from_disk": ["model_path", "load_format", "weight_version", "abort_all_requests"],
    "/pause_generation": ["mode"], "/abort_request": ["rid", "abort_all"],
    "/release_memory_occupation": ["tags"], "/resume_memory_occupation": ["tags"],
}
SAMPLING = ["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "min_new_tokens", "stop", "stop_token_ids",
            "ignore_eos", "skip_special_tokens", "no_stop_trim", "sampling_seed", "n", "frequency_penalty",
            "json_schema", "spaces_between_special_tokens"]
WORDS = st.sampled_from(["abort", "retract", "in_place", "weights", "kv_cache", "safetensors_b64", "cuda_ipc",
                         "direct", "auto", "user", "assistant", "system", "tool", "none", "text", "AAAA", "/tmp",
                         "<tool_call>x</tool_call>", "\ud800", ""])
SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(-3, 300) | st.floats() | st.text(max_size=12)
           | WORDS)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=4), max_leaves=16)
TOKENS = st.lists(st.integers(-2, 300) | st.integers(), min_size=0, max_size=12)


EXTREME = st.sampled_from([2**31, 2**63, 2**64, 2**70, -2**63 - 1, -1, 0.5, float("inf"), "7", None]) | st.integers()
ANY_TEXT = st.text(alphabet=st.characters(exclude_categories=()), max_size=24) | WORDS  # lone surrogates included
PROMPT = st.lists(st.integers(0, 255), min_size=1, max_size=8)  # token ids the tiny model has: requests reach the engine
SAMPLING_PARAMS = st.fixed_dictionaries({"max_new_tokens": st.integers(0, 4)}, optional={
    "temperature": SCALARS, "top_p": SCALARS, "top_k": EXTREME, "min_p": SCALARS, "sampling_seed": EXTREME,
    "min_new_tokens": EXTREME, "stop": st.lists(ANY_TEXT, max_size=2) | SCALARS, "stop_token_ids": TOKENS,
    "n": st.integers(-1, 3), "ignore_eos": SCALARS, "no_stop_trim": SCALARS, "skip_special_tokens": SCALARS,
    "frequency_penalty": SCALARS, "json_schema": SCALARS})
OPTIONS = {"rid": SCALARS | ANY_TEXT, "return_logprob": SCALARS, "stream": st.booleans(), "logprob_start_len": EXTREME,
           "return_text_in_logprobs": SCALARS, "return_indexer_topk": SCALARS, "indexer_topk_start_len": EXTREME,
           "session_id": SCALARS | ANY_TEXT}
GENERATE = (st.fixed_dictionaries({"input_ids": PROMPT | st.lists(PROMPT, min_size=1, max_size=3),
                                   "sampling_params": SAMPLING_PARAMS}, optional=OPTIONS)
            | st.fixed_dictionaries({"text": ANY_TEXT | st.lists(ANY_TEXT, min_size=1, max_size=3),
                                     "sampling_params": SAMPLING_PARAMS}, optional=OPTIONS)
            | st.fixed_dictionaries({}, optional={"input_ids": TOKENS, "text": JSON,
                                                 "sampling_params": JSON | st.lists(SAMPLING_PARAMS), **OPTIONS}))
DEEP = st.integers(100, 100_000).map(lambda n: b"[" * n + b"]" * n)


def _shaped(path: str) -> st.SearchStrategy:
    """A dict of the route's own field names with random values (token lists and sampling dicts where they go)."""
    values = JSON | TOKENS | st.lists(TOKENS, max_size=3) | st.dictionaries(st.sampled_from(SAMPLING), SCALARS,
                                                                             max_size=5)
    return st.dictionaries(st.sampled_from(FIELDS.get(path, ["mode", "rid", "tags"])), values, max_size=5)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from slime_dsa.data.tokenizer import MODEL_VOCAB_SIZE, build_tokenizer, save_tokenizer

    d = tmp_path_factory.mktemp("fuzz_model")
    make_hf_checkpoint(d, seed=0, vocab_size=MODEL_VOCAB_SIZE, eos_token_id=build_tokenizer().eos_token_id)
    save_tokenizer(d)
    with serving(d, max_body_bytes=64 * 1024, max_prompt_tokens=64, body_timeout_s=2.0,
                 weight_dirs=[str(d)]) as srv:
        srv.routes = sorted({(r.method, r.resource.canonical) for r in srv.server.runner.app.router.routes()
                             if r.method in ("GET", "POST")})
        srv.statuses = Counter()
        srv.reference = requests.post(srv.url + "/generate", json=GREEDY, timeout=TIMEOUT_S).json()["output_ids"]
        yield srv


def _send(srv, method: str, path: str, *, body=None, raw: bytes | None = None) -> int:
    if raw is not None:
        r = requests.request(method, srv.url + path, data=raw, headers={"Content-Type": "application/json"},
                             timeout=TIMEOUT_S)
    elif method == "GET":
        r = requests.get(srv.url + path, params=body if isinstance(body, dict) else None, timeout=TIMEOUT_S)
    else:
        r = requests.post(srv.url + path, data=json.dumps(body), headers={"Content-Type": "application/json"},
                          timeout=TIMEOUT_S)
    srv.statuses[r.status_code // 100] += 1
    assert r.status_code < 500, f"{method} {path} {str(body if raw is None else raw)[:300]!r} -> {r.status_code} {r.text[:300]}"
    _restore(srv)
    return r.status_code


def _restore(srv) -> None:
    """Undo what a fuzzed control request may have done: continue generation, resume memory."""
    for path in ("/continue_generation", "/resume_memory_occupation"):
        assert requests.post(srv.url + path, json={}, timeout=TIMEOUT_S).status_code == 200


FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


@given(data=st.data())
@FUZZ
def test_random_json_to_every_route_is_never_a_5xx(server, data):
    method, path = data.draw(st.sampled_from(server.routes), label="route")
    body = data.draw(JSON | _shaped(path), label="body")
    _send(server, method, path, body=body)


@given(data=st.data())
@settings(FUZZ, max_examples=120)
def test_bodies_shaped_like_each_routes_fields_are_never_a_5xx(server, data):
    posts = [route for route in server.routes if route[0] == "POST"]
    method, path = data.draw(st.sampled_from(posts), label="route")
    _send(server, method, path, body=data.draw(_shaped(path), label="body"))


@given(body=GENERATE)
@settings(FUZZ, max_examples=150)
def test_generate_bodies_that_reach_the_engine_are_never_a_5xx(server, body):
    """Valid token ids with random sampling values (extreme integers, lone surrogates, wrong types) get past the
    shape checks and into the engine: where a 2**70 seed or a lone surrogate used to cost a 500."""
    _send(server, "POST", "/generate", body=body)


@given(data=st.data())
@FUZZ
def test_raw_bytes_to_every_route_are_never_a_5xx(server, data):
    method, path = data.draw(st.sampled_from([r for r in server.routes if r[0] == "POST"]), label="route")
    raw = data.draw(st.binary(max_size=200) | ANY_TEXT.map(lambda t: json.dumps({"text": t}).encode()) | DEEP
                    | st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")), label="raw")
    _send(server, method, path, raw=raw)


def test_the_server_is_still_correct_after_the_fuzzing(server, figures):
    assert requests.get(server.url + "/health", timeout=TIMEOUT_S).status_code == 200
    out = requests.post(server.url + "/generate", json=GREEDY, timeout=TIMEOUT_S).json()
    assert out["output_ids"] == server.reference
    assert server.statuses[5] == 0 and server.statuses[4] > 0 and server.statuses[2] > 0, server.statuses
    figures["http_fuzz"] = {"routes": len(server.routes), "requests": sum(server.statuses.values()),
                            **{f"{k}xx": v for k, v in sorted(server.statuses.items())}}
