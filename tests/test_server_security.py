"""The embedded server's state-changing side, tried as an attacker and with bad tensors (issue 21), over real HTTP on
127.0.0.1: every route but the health checks honours the API key, a POST without JSON Content-Type (a web page's
form) is refused, GET /flush_cache is gone, /update_weights_from_disk loads only from --weight-dir directories and
answers the same whether an outside path exists or not; int64, bool and NaN tensors are refused all or nothing,
an update bumps weight_version, and a truncated file is a 400 naming it."""

from __future__ import annotations

import os

import pytest
import requests
import torch
from safetensors.torch import save_file

from slime_dsa.weights.safetensors_b64 import encode_named_tensors
from tests.hf_reference import make_served_model
from tests.test_server import serving

KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("weights") / "model"
    d.mkdir()
    return make_served_model(d)


@pytest.fixture(scope="module")
def server(model_dir):
    with serving(model_dir, api_key=KEY, weight_dirs=[str(model_dir.parent)]) as srv:
        yield srv


def _post(srv, path, body=None, headers=AUTH, **kw):
    r = requests.post(srv.url + path, json={} if body is None else body, headers=headers, timeout=60, **kw)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


def _info(srv):
    return requests.get(srv.url + "/get_server_info", headers=AUTH, timeout=10).json()


def _generate(srv):
    status, body = _post(srv, "/generate", {"input_ids": list(range(5, 25)), "sampling_params": GREEDY,
                                            "return_logprob": True})
    assert status == 200
    return body["output_ids"], [e[0] for e in body["meta_info"]["output_token_logprobs"]]


# ---- the key, the content type, GET -------------------------------------------------------------------------

def test_every_route_but_the_health_checks_needs_the_key(server):
    from rollout.server.app import PUBLIC_PATHS, STATE  # noqa: F401

    routes = {(r.method, r.resource.canonical) for r in server.server.runner.app.router.routes()
              if r.method in ("GET", "POST")}
    assert ("POST", "/update_weights_from_tensor") in routes and ("POST", "/v1/chat/completions") in routes
    for method, path in sorted(routes):
        r = requests.request(method, server.url + path, json={} if method == "POST" else None, timeout=10)
        expected = 200 if path in PUBLIC_PATHS else 401
        assert r.status_code == expected, (method, path, r.status_code, r.text)
    assert not _info(server)["paused"]  # nothing above reached the engine


def test_a_web_pages_form_post_is_refused(server):
    for headers, data in (({"Content-Type": "application/x-www-form-urlencoded"}, "mode=abort"),
                          ({"Content-Type": "text/plain"}, '{"mode": "abort"}'),
                          ({"Content-Type": "multipart/form-data; boundary=x"}, "--x--"),
                          ({}, None)):
        r = requests.post(server.url + "/pause_generation", data=data, headers={**AUTH, **headers}, timeout=10)
        assert r.status_code == 415 and "Content-Type: application/json" in r.json()["error"]["message"]
    assert not _info(server)["paused"]
    r = requests.get(server.url + "/flush_cache", headers=AUTH, timeout=10)  # an <img> tag could send it
    assert r.status_code == 405
    assert _post(server, "/pause_generation", {"mode": "abort"})[0] == 200  # JSON with the key: allowed
    assert _post(server, "/continue_generation")[0] == 200


# ---- /update_weights_from_disk: only from --weight-dir ---------------------------------------------------------

def test_update_from_disk_outside_the_weight_dirs_reveals_nothing(server, model_dir, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (model_dir.parent / "escape").symlink_to(outside)
    replies = [_post(server, "/update_weights_from_disk", {"model_path": path})
               for path in ("/etc", "/no/such/dir", str(outside), str(model_dir.parent / "escape"), "/etc/passwd\x00")]
    assert all(status == 403 for status, _ in replies)
    assert len({str(body) for _, body in replies}) == 1  # one answer, whether the path exists or not
    assert "--weight-dir" in replies[0][1]["message"] and "/etc" not in replies[0][1]["message"]


def test_a_truncated_weight_file_is_a_400_naming_it(server, model_dir):
    broken = model_dir.parent / "broken"
    broken.mkdir()
    data = (model_dir / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    (broken / "config.json").write_text((model_dir / "config.json").read_text())
    before = _generate(server)
    status, reply = _post(server, "/update_weights_from_disk", {"model_path": str(broken)})
    assert status == 400 and reply["success"] is False
    assert str(broken / "model.safetensors") in reply["message"] and "not a readable safetensors file" in reply["message"]
    assert _generate(server) == before


# ---- tensors: validated, all or nothing, the version bumped ---------------------------------------------------

def _update(srv, tensors, **fields):
    return _post(srv, "/update_weights_from_tensor", {"serialized_named_tensors": [encode_named_tensors(tensors)],
                                                       "load_format": "safetensors_b64", **fields})


def test_int_bool_and_nan_tensors_are_refused_and_change_nothing(server):
    from rollout.server.app import STATE

    params = server.server.runner.app[STATE].engine.engine.model.state_dict()
    name = "model.embed_tokens.weight"
    shape = params[name].shape
    good = {"model.norm.weight": params["model.norm.weight"] * 1.5}
    version = _info(server)["weight_version"]
    before = _generate(server)
    nan = torch.randn(shape)
    nan[0, 0] = float("nan")
    for bad, words in ((torch.ones(shape, dtype=torch.int64), "int64"), (torch.ones(shape, dtype=torch.bool), "bool"),
                       (nan, "NaN"), (torch.full(shape, float("inf")), "infinite")):
        status, reply = _update(server, {**good, name: bad})  # a good tensor beside it: all or nothing
        assert status == 400 and reply["success"] is False, reply
        assert name in reply["message"] and words in reply["message"]
        assert _generate(server) == before and _info(server)["weight_version"] == version


def test_an_update_without_a_version_bumps_it(server):
    from rollout.server.app import STATE

    params = server.server.runner.app[STATE].engine.engine.model.state_dict()
    start = int(_info(server)["weight_version"])
    assert _update(server, {"model.norm.weight": params["model.norm.weight"].clone()})[0] == 200
    assert _info(server)["weight_version"] == str(start + 1)
    assert _update(server, {"model.norm.weight": params["model.norm.weight"].clone()}, weight_version="40")[0] == 200
    assert _info(server)["weight_version"] == "40"


def test_a_float16_tensor_is_cast_to_the_models_dtype(server):
    from rollout.server.app import STATE

    params = server.server.runner.app[STATE].engine.engine.model.state_dict()
    half = torch.ones_like(params["model.norm.weight"], dtype=torch.float16)
    assert _update(server, {"model.norm.weight": half})[0] == 200
    assert torch.equal(params["model.norm.weight"], torch.ones_like(params["model.norm.weight"]))


# ---- a keyless server on 127.0.0.1: DNS rebinding -------------------------------------------------------------

def test_a_keyless_loopback_server_answers_only_requests_addressed_to_loopback(model_dir):
    """A web page whose own domain is rebound to 127.0.0.1 sends JSON to a keyless server as same-origin requests
    (no CORS preflight), with its domain in the Host header: it paused the engine and could replace the weights."""
    from tests.test_server import serving

    with serving(model_dir) as srv:  # `serve` without --api-key binds 127.0.0.1
        port = srv.url.rsplit(":", 1)[1]
        for host in (f"attacker.example:{port}", "rebind.example"):
            status, body = _post(srv, "/pause_generation", {"mode": "abort"}, headers={"Host": host})
            assert status == 403 and "Host" in body["error"]["message"], body
            assert requests.get(srv.url + "/get_server_info", headers={"Host": host}, timeout=10).status_code == 403
        assert not requests.get(srv.url + "/get_server_info", timeout=10).json()["paused"]
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", "app.localhost", f"[::1]:{port}"):
            assert _post(srv, "/continue_generation", headers={"Host": host})[0] == 200, host
