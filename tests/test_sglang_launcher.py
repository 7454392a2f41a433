"""The SGLang launcher. SGLang itself cannot run here, so:
- command lines are checked against SGLang's flag names (verified in its sources);
- process management runs a FAKE SGLang server (a tiny script that answers /health; labelled below).
Weight sync with SGLang (payloads, the NCCL broadcast on gloo) is tested in test_weight_formats.py and
test_weight_sync.py.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rollout.sglang import SGLangConfig, SGLangLaunchError, SGLangServer, SpeculativeConfig, build_command, external_urls
from trainers.process_group import free_port

# Every flag build_command can emit, each checked in sgl-project/sglang python/sglang/srt/server_args.py.
VERIFIED_SGLANG_FLAGS = {
    "--model-path", "--host", "--port", "--tp-size", "--dp-size", "--enable-dp-attention", "--mem-fraction-static",
    "--kv-cache-dtype", "--page-size", "--attention-backend", "--nsa-prefill-backend", "--nsa-decode-backend",
    "--dsa-prefill-backend", "--dsa-decode-backend", "--speculative-algorithm", "--speculative-num-steps",
    "--speculative-eagle-topk", "--speculative-num-draft-tokens", "--speculative-draft-model-path",
    "--tool-call-parser", "--reasoning-parser", "--enable-memory-saver", "--enable-return-indexer-topk",
    "--max-running-requests", "--context-length", "--chunked-prefill-size", "--served-model-name", "--api-key",
    "--log-level", "--trust-remote-code", "--tokenizer-path",
}


def glm5_config(**overrides) -> SGLangConfig:
    kwargs = dict(model_path="/models/GLM-5", port=30001, tp=8, dp=8, enable_dp_attention=True,
                  mem_fraction_static=0.85, kv_cache_dtype="fp8_e4m3", page_size=64, attention_backend="nsa",
                  dsa_prefill_backend="flashmla_sparse", dsa_decode_backend="flashmla_kv",
                  speculative=SpeculativeConfig(), enable_memory_saver=True, python="python")
    kwargs.update(overrides)
    return SGLangConfig(**kwargs)


def test_command_for_glm5_nsa_flags():
    cmd = build_command(glm5_config(extra_args=["--disable-radix-cache"]))
    assert cmd == [
        "python", "-m", "sglang.launch_server", "--model-path", "/models/GLM-5", "--host", "127.0.0.1",
        "--port", "30001", "--tp-size", "8", "--dp-size", "8", "--enable-dp-attention",
        "--mem-fraction-static", "0.85", "--kv-cache-dtype", "fp8_e4m3", "--page-size", "64",
        "--attention-backend", "nsa", "--nsa-prefill-backend", "flashmla_sparse", "--nsa-decode-backend", "flashmla_kv",
        "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4", "--tool-call-parser", "glm47", "--reasoning-parser", "glm45",
        "--enable-memory-saver", "--disable-radix-cache",
    ]


def test_command_dsa_flag_style_renames_backend_flags():
    cmd = build_command(glm5_config(dsa_flag_style="dsa"))
    assert cmd[cmd.index("--attention-backend") + 1] == "dsa"
    assert cmd[cmd.index("--dsa-prefill-backend") + 1] == "flashmla_sparse"
    assert cmd[cmd.index("--dsa-decode-backend") + 1] == "flashmla_kv"
    assert not any(a.startswith("--nsa") for a in cmd)
    # "dsa" spelled in the config is written as "nsa" for an older release
    assert build_command(glm5_config(attention_backend="dsa"))[build_command(glm5_config()).index("--attention-backend") + 1] == "nsa"


def test_every_emitted_flag_was_verified_against_sglang():
    full = glm5_config(speculative=SpeculativeConfig(draft_model_path="/d"), enable_return_indexer_topk=True,
                       max_running_requests=64, context_length=4096, chunked_prefill_size=8192,
                       served_model_name="glm", api_key="k", log_level="info", trust_remote_code=True,
                       tokenizer_path="/t")
    for style in ("nsa", "dsa"):
        flags = {a for a in build_command(SGLangConfig(**{**full.__dict__, "dsa_flag_style": style})) if a.startswith("--")}
        assert flags <= VERIFIED_SGLANG_FLAGS, flags - VERIFIED_SGLANG_FLAGS


def test_the_runs_tokenizer_path_reaches_the_sglang_server(tmp_path):
    """A recipe's model.tokenizer_path is the tokenizer SGLang detokenises and matches stop strings with: without
    --tokenizer-path it used the one saved with model.path."""
    from slime_dsa.config import RecipeConfig
    from slime_dsa.orchestrator.setup import sglang_config

    recipe = RecipeConfig.model_validate({"model": {"path": str(tmp_path / "m"), "preset": None,
                                                    "tokenizer_path": str(tmp_path / "t")}})
    cmd = build_command(sglang_config(recipe, tmp_path / "m"))
    assert cmd[cmd.index("--tokenizer-path") + 1] == str(tmp_path / "t")
    assert "--tokenizer-path" not in build_command(SGLangConfig(model_path="m"))


def test_minimal_command_leaves_defaults_to_sglang():
    cmd = build_command(SGLangConfig(model_path="m", python="py", tool_call_parser=None, reasoning_parser=None,
                                     mem_fraction_static=None))
    assert cmd == ["py", "-m", "sglang.launch_server", "--model-path", "m", "--host", "127.0.0.1", "--port", "30000",
                   "--tp-size", "1"]


@pytest.mark.parametrize("overrides, field", [
    ({"kv_cache_dtype": "fp4"}, "kv_cache_dtype"),
    ({"tp": 6, "dp": 4}, "tp (6) must be divisible by dp (4)"),
    ({"mem_fraction_static": 1.5}, "mem_fraction_static"),
    ({"dsa_decode_backend": "magic"}, "dsa_decode_backend"),
    ({"dsa_flag_style": "v4"}, "dsa_flag_style"),
    ({"speculative": SpeculativeConfig(algorithm="MEDUSA")}, "speculative.algorithm"),
    ({"port": 0}, "port"),
])
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(")", r"\)")):
        build_command(glm5_config(**overrides))


def test_external_urls():
    assert external_urls("10.0.0.1:30000, http://h:1/ ,") == ["http://10.0.0.1:30000", "http://h:1"]
    with pytest.raises(ValueError):
        external_urls(" , ")


# ---- process management with a FAKE SGLang server ---------------------------------------------------------

FAKE_SGLANG = textwrap.dedent('''
    """FAKE SGLang server for launcher tests (NOT SGLang): it takes SGLang's command-line flags and answers
    GET /health with 200. FAKE_SGLANG_DIE_AFTER=S makes the first run exit with code 7 after S seconds;
    FAKE_SGLANG_EXIT_AT_START=1 makes every run exit with code 3 at once."""
    import argparse, http.server, os, sys, threading, time

    parser = argparse.ArgumentParser()
    for flag in ("--model-path", "--host", "--tp-size"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args()
    print(f"fake sglang pid={os.getpid()} port={args.port} argv={sys.argv[1:]}", flush=True)
    if os.environ.get("FAKE_SGLANG_EXIT_AT_START"):
        print("fake sglang: failing at start", flush=True)
        sys.exit(3)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer((args.host, args.port), Health)
    marker = os.environ.get("FAKE_SGLANG_MARKER", "")
    die_after = float(os.environ.get("FAKE_SGLANG_DIE_AFTER", "0"))
    if die_after and not os.path.exists(marker):
        def die():
            time.sleep(die_after)
            try:
                open(marker, "w").close()
            except OSError:
                pass
            print("fake sglang: dying", flush=True)
            os._exit(7)
        threading.Thread(target=die, daemon=True).start()
    server.serve_forever()
''')


def _fake_server(tmp_path: Path, env: dict, max_restarts: int = 2) -> SGLangServer:
    script = tmp_path / "fake_sglang.py"
    script.write_text(FAKE_SGLANG)
    config = SGLangConfig(model_path=str(tmp_path), port=free_port(), python=sys.executable)
    real = build_command(config)
    assert real[1:3] == ["-m", "sglang.launch_server"]
    command = [sys.executable, str(script), *real[3:]]  # the launcher's own flags, fed to the fake
    return SGLangServer(config, command=command, env=env, max_restarts=max_restarts, poll_interval_s=0.2,
                        health_timeout_s=20, log_path=tmp_path / "sglang.log")


def _wait(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_launcher_restarts_a_dead_server_then_stops_it(tmp_path):
    from rollout.sglang.launcher import http_ok

    server = _fake_server(tmp_path, {"FAKE_SGLANG_DIE_AFTER": "1.0", "FAKE_SGLANG_MARKER": str(tmp_path / "died")})
    try:
        url = server.start()
        first_pid = server.pid
        assert http_ok(url + "/health")
        assert _wait(lambda: server.restarts == 1 and server.pid != first_pid), "watchdog did not restart the server"
        assert _wait(lambda: http_ok(url + "/health")), "restarted server never became healthy"
        assert server.failed is None
        log = (tmp_path / "sglang.log").read_text()
        assert log.count("fake sglang pid=") == 2 and "fake sglang: dying" in log
    finally:
        server.stop(timeout_s=5)
    assert not server.alive() and not http_ok(server.url + "/health", timeout_s=1)


def test_launch_failure_reports_exit_code_and_log_tail(tmp_path):
    server = _fake_server(tmp_path, {"FAKE_SGLANG_EXIT_AT_START": "1"}, max_restarts=1)
    with pytest.raises(SGLangLaunchError, match="(?s)exited with code 3.*failing at start"):
        server.start()
    server.stop()


def test_watchdog_stops_after_max_restarts(tmp_path):
    # dies after 0.5 s on every run (a fresh marker path each time makes "first run" always true)
    server = _fake_server(tmp_path, {"FAKE_SGLANG_DIE_AFTER": "0.5", "FAKE_SGLANG_MARKER": "/nonexistent/dir/m"},
                          max_restarts=1)
    try:
        server.start()
        assert _wait(lambda: server.failed is not None), "watchdog kept restarting past max_restarts"
        assert server.restarts == 1 and "max_restarts is 1" in server.failed
    finally:
        server.stop(timeout_s=5)


@pytest.mark.parametrize("new_api", [True, False])
def test_register_with_router(new_api):
    """Against a FAKE sglang_router (an aiohttp app with the router's two registration endpoints; NOT SGLang)."""
    from aiohttp import web

    from rollout.sglang import register_with_router

    seen = []

    async def workers(request):
        seen.append(("POST /workers", await request.json()))
        return web.json_response({"status": "accepted"}, status=202)

    async def add_worker(request):
        seen.append(("POST /add_worker", dict(request.query)))
        return web.Response(text="ok")

    async def scenario():
        app = web.Application()
        if new_api:
            app.router.add_post("/workers", workers)
        app.router.add_post("/add_worker", add_worker)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            await register_with_router(f"127.0.0.1:{port}", "http://10.0.0.2:30000")
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
    if new_api:
        assert seen == [("POST /workers", {"url": "http://10.0.0.2:30000", "worker_type": "regular"})]
    else:
        assert seen == [("POST /add_worker", {"url": "http://10.0.0.2:30000"})]


def test_sglang_engine_actor_with_fake_server(ray_cluster, tmp_path):
    """EngineActor(kind="sglang") runs the launcher's real command line; `python` is a wrapper that hands the
    flags to the FAKE SGLang server script instead of `-m sglang.launch_server`."""
    from rollout.actors import create_engine_actors, start_engine_actors
    from rollout.sglang.launcher import http_ok

    script = tmp_path / "fake_sglang.py"
    script.write_text(FAKE_SGLANG)
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\n# drops '-m sglang.launch_server', keeps every flag\nshift 2\nexec {sys.executable} {script} \"$@\"\n")
    wrapper.chmod(0o755)
    config = SGLangConfig(model_path=str(tmp_path), python=str(wrapper), speculative=SpeculativeConfig())
    actor, = create_engine_actors(1, kind="sglang", sglang_config=config, num_cpus_per_engine=1,
                                  launcher_kwargs={"log_path": str(tmp_path / "actor.log"), "poll_interval_s": 0.2})
    try:
        url, = start_engine_actors([actor], timeout_s=60)
        assert http_ok(url + "/health")
        log = (tmp_path / "actor.log").read_text()
        assert "--speculative-algorithm', 'EAGLE'" in log and f"--port', '{url.rsplit(':', 1)[1]}'" in log
        ray_cluster.get(actor.stop.remote())
        assert not http_ok(url + "/health", timeout_s=1)
    finally:
        ray_cluster.kill(actor)
