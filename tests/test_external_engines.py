"""`rollout.engine: external` against a real `slime-dsa serve` app over HTTP on 127.0.0.1: what the run does with the
servers it did not start, before Ray starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from slime_dsa.cli import main

ROOT = Path(__file__).resolve().parents[1]
BASE = str(ROOT / "recipes" / "base.yaml")
KEY = "the-servers-key"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tests.hf_reference import make_served_model

    directory = tmp_path_factory.mktemp("served") / "model"
    directory.mkdir()
    return make_served_model(directory)


@pytest.fixture(scope="module")
def server(model_dir):
    """`serve --model DIR --api-key KEY` without --weight-dir: /update_weights_from_disk loads nothing."""
    from tests.test_server import serving

    with serving(model_dir, api_key=KEY) as srv:
        yield srv


@pytest.fixture
def no_ray(monkeypatch):
    """cluster.init_ray raises: a test sees whether the run got past its checks to Ray."""
    from slime_dsa.orchestrator import cluster  # noqa: PLC0415

    def init_ray(recipe):
        raise AssertionError("Ray started")

    monkeypatch.setattr(cluster, "init_ray", init_ray)


def _train(server, tmp_path, *overrides: str) -> int:
    sets = [f"rollout.engine_urls=['{server.url}']", "data.tasks=[{kind: arithmetic, train_size: 64, eval_size: 0}]",
            f"logging.run_dir={tmp_path / 'run'}", "logging.wandb_mode=disabled", *overrides]
    return main(["train", BASE, "--set", "rollout.engine=external", *(a for s in sets for a in ("--set", s))])


@pytest.mark.parametrize("key", ["wrong", None])
def test_an_external_engine_that_refuses_the_key_is_one_line_before_ray(server, tmp_path, monkeypatch, capsys, no_ray,
                                                                         key):
    """The server answered every /generate with 401; the run counted each sample failed, skipped every step and
    finished with exit code 0, having trained nothing."""
    if key is None:
        monkeypatch.delenv("SLIME_DSA_API_KEY", raising=False)
    else:
        monkeypatch.setenv("SLIME_DSA_API_KEY", key)
    assert _train(server, tmp_path) == 2
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"rollout.engine_urls[0]: {server.url} refused" in err and "401" in err, err
    assert "set $SLIME_DSA_API_KEY to the key the server was started with" in err, err


def test_an_external_engine_that_takes_the_key_lets_the_run_start(server, tmp_path, monkeypatch, no_ray):
    monkeypatch.setenv("SLIME_DSA_API_KEY", KEY)
    with pytest.raises(AssertionError, match="Ray started"):
        _train(server, tmp_path)


def test_a_refused_weight_update_is_a_refusal_not_a_lost_engine(server):
    """post_update turns an engine's 4xx into WeightUpdateRefusedError, which the run reports in one line."""
    import asyncio

    from rollout.client import EngineClient
    from slime_dsa.orchestrator.weight_sync.base import WeightUpdateRefusedError, post_update

    async def refused() -> None:
        async with EngineClient([server.url], api_key=KEY) as client:
            with pytest.raises(WeightUpdateRefusedError, match="403: model_path is not in a directory"):
                await post_update(client, "/update_weights_from_disk", {"model_path": "/dev/shm/elsewhere"})
            assert list(client.engines) == [server.url]  # a refusal drops no engine

    asyncio.run(refused())


def _alive_actors(ray, class_name: str, expected: int | None = None, timeout_s: float = 20.0) -> int:
    """Actors of `class_name` alive in the session's Ray cluster; with `expected`, waited for up to `timeout_s` to
    become that many (a killed actor is marked dead a moment later)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        alive = sum(1 for a in ray._private.state.actors().values()
                    if a.get("State") != "DEAD" and a.get("ActorClassName", "").endswith(class_name))
        if expected is None or alive == expected or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


@pytest.mark.slow
def test_weights_an_external_engine_refuses_stop_the_run_with_one_line(server, model_dir, tmp_path, monkeypatch,
                                                                        capsys, ray_cluster):
    """rollout.weight_sync shm to a `serve` engine without --weight-dir: every push is a 403. The run died after its
    first step with a traceback of rollout.client.EngineError; the push of the initial weights now refuses first."""
    monkeypatch.setenv("SLIME_DSA_API_KEY", KEY)
    ranks_before = _alive_actors(ray_cluster, "FSDPWorker")
    code = _train(server, tmp_path, f"model.path={model_dir}", "rollout.weight_sync=shm", "trainer.num_workers=1",
                  "trainer.num_steps=2", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
                  "rollout.max_response_length=4", "logging.eval_every=0", "checkpoint.save_every=0")
    # its trainer rank stopped with it: it stayed alive, holding a CPU a later run in the session waited for for ever
    assert _alive_actors(ray_cluster, "FSDPWorker", expected=ranks_before) == ranks_before
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    line = err.splitlines()[-1]
    assert line.startswith(f"slime-dsa: error: the engines refused the weights of {model_dir}: POST "
                           f"/update_weights_from_disk failed on 1 of 1 engines: {server.url} (403: model_path is not "
                           "in a directory"), line
    assert "start `slime-dsa serve` with --weight-dir /dev/shm, or set rollout.weight_sync http" in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()


@pytest.mark.slow
def test_an_external_engine_samples_step_1_from_the_runs_initial_weights(server, tmp_path, monkeypatch,
                                                                         ray_cluster):
    """A server that holds other weights (another run's last push) answered step 1 with them: the run trained on
    samples of another policy (train_rollout_logprob_abs_diff 1.09 with a perturbed server) and warned only."""
    import json

    from slime_dsa.data.tokenizer import MODEL_VOCAB_SIZE, build_tokenizer, save_tokenizer
    from tests.hf_reference import make_hf_checkpoint

    other = tmp_path / "other"  # the run's model.path: the server's architecture, other weights
    other.mkdir()
    make_hf_checkpoint(other, seed=1, vocab_size=MODEL_VOCAB_SIZE, eos_token_id=build_tokenizer().eos_token_id)
    save_tokenizer(other)
    monkeypatch.setenv("SLIME_DSA_API_KEY", KEY)
    assert _train(server, tmp_path, f"model.path={other}", "rollout.weight_sync=http", "trainer.num_workers=1",
                  "trainer.num_steps=1", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
                  "rollout.max_response_length=4", "logging.eval_every=0", "checkpoint.save_every=0") == 0
    (step,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert step["train/train_rollout_logprob_abs_diff"] < 1e-4, step["train/train_rollout_logprob_abs_diff"]


@pytest.mark.slow
def test_a_resume_whose_weights_an_external_engine_refuses_is_one_line(server, model_dir, tmp_path, monkeypatch,
                                                                      capsys, ray_cluster):
    """--resume pushes the checkpoint's weights before the first step: a refusal there was a WeightUpdateRefusedError
    traceback, then asyncio's 'Unclosed client session' errors."""
    monkeypatch.setenv("SLIME_DSA_API_KEY", KEY)
    small = [f"model.path={model_dir}", "trainer.num_workers=1", "rollout.prompts_per_step=2",
             "rollout.n_samples_per_prompt=2", "rollout.max_response_length=4", "logging.eval_every=0",
             "checkpoint.save_every=1"]
    assert _train(server, tmp_path, *small, "rollout.weight_sync=http", "trainer.num_steps=1") == 0
    capsys.readouterr()
    code = main(["train", BASE, "--resume", *(a for s in [
        "rollout.engine=external", f"rollout.engine_urls=['{server.url}']", f"logging.run_dir={tmp_path / 'run'}",
        "data.tasks=[{kind: arithmetic, train_size: 64, eval_size: 0}]", "logging.wandb_mode=disabled", *small,
        "rollout.weight_sync=shm", "trainer.num_steps=2"] for a in ("--set", s))])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "Unclosed" not in err, err
    line = err.splitlines()[-1]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert line.startswith(f"slime-dsa: error: the engines refused the weights of {checkpoints}"), line
    assert "403" in line and "--weight-dir /dev/shm" in line, line


def test_a_refusal_mid_run_is_one_line_naming_the_step_and_the_newest_checkpoint(tmp_path):
    """A push the engines refuse after the start (a server restarted without --weight-dir) is the run's one line."""
    import asyncio
    from types import SimpleNamespace

    from slime_dsa.config import validate_recipe
    from slime_dsa.orchestrator.train import _failure_line
    from slime_dsa.orchestrator.weight_sync.base import WeightUpdateRefusedError

    recipe = validate_recipe({"rollout": {"engine": "external", "engine_urls": ["http://127.0.0.1:1"]}})
    run = SimpleNamespace(recipe=recipe, progress=SimpleNamespace(current=7),
                          ckpts=SimpleNamespace(latest=lambda: tmp_path / "step_000005"),
                          weights=SimpleNamespace(directory=Path("/dev/shm/slime-dsa-weights-1-ab")))
    line = asyncio.run(_failure_line(run, WeightUpdateRefusedError("POST /update_weights_from_disk failed ...")))
    assert line == ("the engines refused the weights of step 7: POST /update_weights_from_disk failed ... (they load "
                    "them from /dev/shm/slime-dsa-weights-1-ab: start `slime-dsa serve` with --weight-dir /dev/shm, or "
                    f"set rollout.weight_sync http); the newest checkpoint is {tmp_path / 'step_000005'}; --resume "
                    "continues from it")


@pytest.mark.parametrize("key", [KEY, None])
def test_an_external_teacher_is_sent_the_key_from_the_environment(server, model_dir, monkeypatch, key):
    """teachers.N.serving external on a keyed server: its scorer sent no key, so every request got a 401 and the run
    stopped at the teacher's probe; it now sends $SLIME_DSA_API_KEY, as external rollout engines do."""
    import asyncio

    from rollout.server.defaults import API_KEY_ENV
    from slime_dsa.config import validate_recipe
    from slime_dsa.config.errors import UserError
    from slime_dsa.orchestrator.teachers import Teachers

    recipe = validate_recipe({
        "algorithm": {"name": "opd"}, "data": {"tasks": [{"kind": "arithmetic"}]},
        "teachers": [{"name": "far", "path": str(model_dir), "domains": ["arithmetic"], "serving": "external",
                      "urls": [server.url]}]})
    if key is None:
        monkeypatch.delenv(API_KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(API_KEY_ENV, key)

    async def probe() -> None:
        teachers = Teachers(recipe, temperature=1.0, top_k=0)
        try:
            await teachers.start([5, 6, 7])
        finally:
            await teachers.close()

    if key is None:
        with pytest.raises(UserError, match="teacher 'far' cannot score"):
            asyncio.run(probe())
    else:
        asyncio.run(probe())



def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`slime-dsa serve --model DIR --port PORT` in a subprocess, up once /health answers; killed with SIGKILL (a crash:
    its connections reset, nothing answered)."""

    def __init__(self, model_dir: Path, port: int) -> None:
        import os
        import subprocess
        import sys
        import time

        import requests

        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("SLIME_DSA_API_KEY", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "slime_dsa.cli", "serve", "--model", str(model_dir),
                                      "--port", str(port), "--max-cache-tokens", "2048"], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        self.kill()
        raise AssertionError(f"slime-dsa serve on port {port} did not come up")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.mark.slow
def test_a_lost_external_server_is_readmitted_only_with_the_runs_weights(model_dir, caplog):
    """A `serve` engine SIGKILLed and started again on its port (so holding the model's weights, version 0). Before: a
    restart noticed by failed requests was routed to again at once, serving version 0 after the run had pushed 1, and
    one lost during a push was never routed to again. Now either is dropped, probed on /health and staged: it serves
    only after the next push has given it the run's weights; the request in flight when it died fails alone."""
    import asyncio
    import logging
    from types import SimpleNamespace

    from safetensors.torch import load_file

    from rollout.client import EngineClient, EngineUnavailableError
    from slime_dsa.orchestrator.engines import EngineFleet
    from slime_dsa.orchestrator.step import sync_weights
    from slime_dsa.orchestrator.weight_sync.http import HttpTransport

    port = _free_port()
    # FAKE trainer group: its full_state_dict is the served model's own tensors (the push is real HTTP).
    trainers = SimpleNamespace(full_state_dict=lambda: load_file(str(model_dir / "model.safetensors")))
    params = {"max_new_tokens": 2, "temperature": 0}

    async def served_version(client: EngineClient) -> str:
        return (await client.generate([5, 6, 7], params))["meta_info"]["weight_version"]

    async def scenario() -> None:
        srv = await asyncio.to_thread(Served, model_dir, port)
        client = EngineClient([srv.url], max_failures=1, probe_interval_s=0.1, max_retries=1, backoff_s=0.05,
                              timeout_s=60)
        fleet = EngineFleet(client, {}, None, readmit=[srv.url])
        fleet.start()
        transport = HttpTransport(client, trainers)
        try:
            await transport.push(1)
            assert await served_version(client) == "1"
            # (a) it dies with a request in flight and comes back before the next push
            in_flight = asyncio.ensure_future(client.generate([5, 6, 7], {"max_new_tokens": 400, "ignore_eos": True}))
            while not any(e.outstanding for e in client.engines.values()):
                await asyncio.sleep(0.005)
            srv.kill()
            with pytest.raises(EngineUnavailableError):
                await in_flight  # one sample's cost (rollout.groups counts it failed), not the run's
            srv = await asyncio.to_thread(Served, model_dir, port)
            for _ in range(200):
                if client.staged:
                    break
                await asyncio.sleep(0.05)
            assert client.staged == [srv.url] and not client.engines, (client.staged, list(client.engines))
            assert "not the run's '1'" in client.lost[-1][1], client.lost
            with pytest.raises(EngineUnavailableError):
                await served_version(client)  # refused work, never version 0
            await transport.push(2)
            assert await served_version(client) == "2"
            # (b) it is lost during a push: the push waits for it to come back and gives it the weights
            srv.kill()
            restart = asyncio.ensure_future(asyncio.to_thread(Served, model_dir, port))
            await sync_weights(transport, 3, fleet=fleet)
            srv = await restart
            assert await served_version(client) == "3"
        finally:
            await fleet.close()
            await client.close()
            srv.kill()

    with caplog.at_level(logging.INFO):
        asyncio.run(scenario())
    said = [r.getMessage() for r in caplog.records]
    url = f"http://127.0.0.1:{port}"
    assert sum(m.startswith(f"external engine {url} dropped: probing its /health") for m in said) == 2, said
    assert sum(m.startswith(f"external engine {url} answers /health again: re-admitted") for m in said) == 2, said


@pytest.mark.slow
def test_a_run_goes_on_when_its_external_server_dies_and_comes_back(model_dir, tmp_path, monkeypatch, ray_cluster):
    """`train` on one `serve` engine, SIGKILLed after step 2's push and started again on its port. Before: step 3 got
    no sample, the run dropped the server and stopped ('rollout engines lost at step 3'). Now it probes the server,
    re-admits it at the next push, and step 4 samples from the run's weights."""
    import json
    import threading

    from slime_dsa.config import load_recipe
    from slime_dsa.orchestrator.train import run_training

    monkeypatch.delenv("SLIME_DSA_API_KEY", raising=False)
    port = _free_port()
    servers = [Served(model_dir, port)]

    def kill_after_step_2(version, state):
        if version == 2:
            servers[-1].kill()
            threading.Thread(target=lambda: servers.append(Served(model_dir, port)), daemon=True).start()

    sets = ["rollout.engine=external", f"rollout.engine_urls=['{servers[0].url}']", f"model.path={model_dir}",
            "data.tasks=[{kind: arithmetic, train_size: 64, eval_size: 0}]", f"logging.run_dir={tmp_path / 'run'}",
            "logging.wandb_mode=disabled", "rollout.weight_sync=http", "trainer.num_workers=1", "trainer.num_steps=4",
            "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2", "rollout.max_response_length=4",
            "logging.eval_every=0", "checkpoint.save_every=0"]
    try:
        run_training(load_recipe(BASE, sets), on_weights=kill_after_step_2, hook_state="every")
    finally:
        for server in servers:
            server.kill()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 4 and records[-1]["rollout/num_samples"] == 4, records[-1]
    assert records[-1]["train/train_rollout_logprob_abs_diff"] < 1e-4  # sampled from the run's weights, not v0
    log, url = (tmp_path / "run" / "train.log").read_text(), servers[0].url
    # Two ways back, by timing: dropped by the client, probed and re-admitted at a push; or, when the new server is
    # up before step 3's push, still only marked dead, so that push reaches it and gives it the run's weights.
    readmitted = (f"external engine {url} dropped: probing its /health" in log
                  and f"external engine {url} answers /health again: re-admitted" in log)
    pushed_while_marked_dead = f"engine {url} marked dead" in log and "weights v3 to 1 engine(s)" in log
    assert readmitted or pushed_while_marked_dead, log
