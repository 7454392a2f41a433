"""What one request can cost the embedded server: a large text is refused by its size before it is tokenised, text
is tokenised off the event loop (so /health and other requests go on), a body that stalls half-sent gets 408, and
malformed bodies (a 2**70 seed, a lone surrogate, deep nesting) get 400, never 500. Real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import requests

from tests.hf_reference import make_hf_checkpoint
from tests.test_server import serving


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from slime_dsa.data.tokenizer import MODEL_VOCAB_SIZE, build_tokenizer, save_tokenizer

    d = tmp_path_factory.mktemp("model")
    make_hf_checkpoint(d, seed=0, vocab_size=MODEL_VOCAB_SIZE, eos_token_id=build_tokenizer().eos_token_id)
    save_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def server(model_dir):
    # the default body and prompt limits (16 MiB, 32768 tokens); a short body deadline for the stalled-body test
    with serving(model_dir, body_timeout_s=1.0) as srv:
        yield srv


class HealthWatch:
    """Polls /health from a thread while a request runs; .worst is the slowest answer in seconds."""

    def __init__(self, url: str) -> None:
        self.url, self.worst, self._stop = url, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                requests.get(self.url + "/health", timeout=30)
            except requests.RequestException:
                pass
            self.worst = max(self.worst, time.perf_counter() - start)
            time.sleep(0.05)

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _post(srv, path, body, timeout=20):
    r = requests.post(srv.url + path, json=body, timeout=timeout)
    return r.status_code, r.json()


def assert_still_serving(srv):
    status, body = _post(srv, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2,
                                                                                       "ignore_eos": True}})
    assert status == 200 and body["meta_info"]["completion_tokens"] == 2


def test_a_15_mib_text_is_refused_by_its_size_before_tokenising(server, figures):
    text = "12+34=" * (15 * 2**20 // 6)
    with HealthWatch(server.url) as watch:
        start = time.perf_counter()
        status, reply = _post(server, "/generate", {"text": text, "sampling_params": {"max_new_tokens": 1}})
        elapsed = time.perf_counter() - start
    assert status == 413 and reply["error"]["message"].startswith(f"text has {len(text)} characters")
    assert elapsed < 5 and watch.worst < 1.0, (elapsed, watch.worst)
    figures["text_15_mib"] = {"status": status, "answer_s": round(elapsed, 3), "worst_health_s": round(watch.worst, 3)}
    for path, body in (("/v1/completions", {"prompt": text}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})):
        status, reply = _post(server, path, body)
        assert status == 413 and ("prompt has" in reply["error"]["message"] or "messages has" in reply["error"]["message"])
    assert_still_serving(server)


def test_text_is_tokenised_off_the_event_loop(model_dir, figures):
    text = "12+34=" * 400_000  # 2.4M characters: seconds of tokenising, within a 100k-token limit's size bound
    with serving(model_dir, max_prompt_tokens=100_000) as srv, HealthWatch(srv.url) as watch:
        status, reply = _post(srv, "/generate", {"text": text, "sampling_params": {"max_new_tokens": 1}}, timeout=60)
    assert status == 400 and "tokens; the limit is 100000" in reply["error"]["message"]  # it was tokenised
    assert watch.worst < 1.0, watch.worst
    figures["text_2_4m_chars_tokenised"] = {"status": status, "worst_health_s": round(watch.worst, 3)}


def test_a_body_that_stalls_half_sent_gets_408(server):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"input_ids\": [1, ")
        start = time.perf_counter()
        reply = sock.recv(4096).decode()
        elapsed = time.perf_counter() - start
    assert reply.startswith("HTTP/1.1 408") and "body_timeout_s" in reply and elapsed < 5
    assert_still_serving(server)


@pytest.mark.parametrize("raw, message", [
    (b'{"input_ids": [1, 2], "sampling_params": {"sampling_seed": 1180591620717411303424}}', "sampling_seed"),
    (b'{"text": "a\\ud800b", "sampling_params": {"max_new_tokens": 1}}', "surrogate"),
    (b'{"rid": "\\udfff", "input_ids": [1]}', "surrogate"),
    (b"[" * 100_000 + b"]" * 100_000, "nests too deeply"),
    (b'{"input_ids": ' + b"[" * 5_000 + b"]" * 5_000 + b"}", ""),
])
def test_malformed_bodies_get_400_not_500(server, raw, message):
    r = requests.post(server.url + "/generate", data=raw, headers={"Content-Type": "application/json"}, timeout=20)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    assert_still_serving(server)


def test_a_client_that_disconnects_mid_body_is_no_server_error(server, caplog):
    # a half-sent body and a closed socket: aiohttp logged "Error handling request" with a traceback (an ERROR, as if
    # the server had failed) because the read's ConnectionResetError escaped the handler
    host, port = server.url.removeprefix("http://").split(":")
    with caplog.at_level("INFO"):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"input_ids\": [1, ")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any("closed the connection" in r.getMessage() or
                                                      r.levelname == "ERROR" for r in caplog.records):
            time.sleep(0.05)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], [r.getMessage() for r in caplog.records]
    assert any("closed the connection before its request body arrived" in r.getMessage() for r in caplog.records)
    assert_still_serving(server)
