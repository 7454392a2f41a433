"""Weight transports (slime_dsa.orchestrator.weight_sync): the choice, the one pause → update → continue routine,
and every transport from a real trainer rank to a real receiver over 127.0.0.1.

The trainer is a real FSDPWorker (world size 1, gloo) holding checkpoint 1; embedded servers start from checkpoint
0. After a push an engine must hold exactly the trainer's tensors and report the pushed version. SGLang cannot run
here: the distributed transport broadcasts over gloo to a FAKE SGLang weight receiver (labelled below) that joins
the group exactly as SGLang's worker does. cuda_ipc needs a GPU: its push is checked against a labelled fake
client here, end to end in test_cuda_ipc.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from slime_dsa.orchestrator.weight_sync import (CudaIpcTransport, DiskTransport, DistributedTransport, HttpTransport,
                                                SHM_ROOT, build_weight_sync, choose_sglang_transport, choose_transport,
                                                paused_update)
from slime_dsa.config.errors import UserError
from slime_dsa.orchestrator.weight_sync.base import post_update
from tests.test_server import checkpoints, serving  # noqa: F401 (checkpoints is a fixture)
from trainers.process_group import free_port


@pytest.fixture(scope="module")
def trainer(checkpoints):  # noqa: F811
    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from trainers.base import policy_config  # noqa: PLC0415
    from trainers.fsdp.worker import FSDPWorker  # noqa: PLC0415

    config = policy_config(str(checkpoints[1]), PPOLoss(), frozen=(".indexer.",), ops_backend="torch")
    w = FSDPWorker(0, 1, "127.0.0.1", free_port(), config)
    yield w
    w.shutdown()


def _engine(srv):
    from rollout.server.app import STATE  # noqa: PLC0415

    return srv.server.runner.app[STATE].engine


# ---- the choice ---------------------------------------------------------------------------------------------


def test_choose_transport(tmp_path):
    assert choose_transport("auto", "embedded", ["a", "a"], "a", 1000, shm_root=tmp_path) == "shm"
    assert choose_transport("auto", "embedded", ["a", "b"], "a", 1000, shm_root=tmp_path) == "http"
    assert choose_transport("auto", "external", [], "a", 1000, shm_root=tmp_path) == "http"
    assert choose_transport("auto", "embedded", ["a"], None, 1000, shm_root=tmp_path) == "http"
    assert choose_transport("auto", "embedded", ["a"], "a", 10**18, shm_root=tmp_path) == "http"  # no room
    assert choose_transport("auto", "embedded", ["a"], "a", 1000, shm_root=tmp_path / "missing") == "http"
    assert choose_transport("http", "embedded", ["a"], "a", 1000, shm_root=tmp_path) == "http"
    assert choose_transport("shm", "external", [], None, 10**18, shm_root=tmp_path) == "shm"  # as asked
    assert choose_transport("shm", "embedded", ["a", "a"], "a", 1000, shm_root=tmp_path) == "shm"
    with pytest.raises(UserError, match="'shm' needs every engine on trainer rank 0's Ray node"):
        choose_transport("shm", "embedded", ["a", "b"], "a", 1000, shm_root=tmp_path)  # was: engines found no file
    with pytest.raises(ValueError, match="rollout.weight_sync 'shm'"):
        choose_transport("shm", "embedded", ["a"], "a", 1000, shm_root=tmp_path / "missing")
    # rank 0 and the engines on a node besides the driver's, which makes the shm directory in its own /dev/shm
    assert choose_transport("auto", "embedded", ["a"], "a", 1000, shm_root=tmp_path, driver_node="d") == "http"
    assert choose_transport("auto", "embedded", ["a"], "a", 1000, shm_root=tmp_path, driver_node="a") == "shm"
    with pytest.raises(UserError, match="'shm' needs trainer rank 0 on this driver's Ray node"):
        choose_transport("shm", "embedded", ["a"], "a", 1000, shm_root=tmp_path, driver_node="d")
    with pytest.raises(ValueError, match="rollout.weight_sync"):
        choose_transport("disk", "embedded", ["a"], "a", 1000, shm_root=tmp_path)
    # SGLang servers never get our safetensors_b64 or cuda_ipc bodies: they have a key of their own
    with pytest.raises(ValueError, match="rollout.sglang.weight_sync"):
        choose_transport("auto", "sglang", ["a"], "a", 1000, shm_root=tmp_path)


def test_choose_transport_picks_cuda_ipc_only_on_the_trainers_gpu(tmp_path):
    def choose(setting="auto", kind="embedded", nodes=("a", "a"), devices=("G0", "G0"), trainer="G0"):
        return choose_transport(setting, kind, list(nodes), "a", 1000, shm_root=tmp_path,
                                engine_devices=list(devices), trainer_device=trainer)

    assert choose() == "cuda_ipc"
    assert choose(devices=("G0", "G1")) == "shm"  # same node, another GPU
    assert choose(devices=("G0", None)) == "shm"  # an engine on the CPU
    assert choose(trainer=None) == "shm"  # trainer on the CPU
    assert choose(nodes=("a", "b")) == "http"
    assert choose("shm") == "shm" and choose("http") == "http"  # as asked
    assert choose("cuda_ipc") == "cuda_ipc"
    for kwargs, message in (({"devices": ("G0", "G1")}, "rollout.weight_sync 'cuda_ipc' needs every engine on trainer "
                                                         "rank 0's GPU (G0); engine 1 is on GPU G1"),
                            ({"devices": (None, "G0")}, "engine 0 is not on a CUDA device"),
                            ({"trainer": None}, "needs trainer rank 0 on a CUDA device"),
                            ({"nodes": ("b", "a")}, "needs every engine on trainer rank 0's Ray node"),
                            ({"kind": "external", "nodes": ()}, "needs embedded engines, got rollout.engine 'external'")):
        with pytest.raises(ValueError) as err:
            choose("cuda_ipc", **kwargs)
        assert message in str(err.value)


def test_choose_sglang_transport():
    assert choose_sglang_transport("auto", "disaggregated") == "distributed"
    assert choose_sglang_transport("auto", "colocated") == "disk"  # NCCL cannot put two ranks on one GPU
    assert choose_sglang_transport("distributed", "colocated") == "distributed"  # as asked
    assert choose_sglang_transport("disk", "disaggregated") == "disk"
    with pytest.raises(ValueError, match="rollout.sglang.weight_sync 'tensor' is not available"):
        choose_sglang_transport("tensor", "colocated")


def test_build_weight_sync_follows_rollout_sglang_weight_sync(checkpoints, tmp_path):  # noqa: F811
    from slime_dsa.config import validate_recipe  # noqa: PLC0415

    def build(setting: str, placement: str):
        recipe = validate_recipe({"rollout": {"engine": "sglang", "sglang": {"weight_sync": setting, "tp": 2}},
                                  "cluster": {"placement": placement, "num_gpus_per_engine": 2}})
        return build_weight_sync(recipe, None, None, [], checkpoints[1], tmp_path / "run")

    nccl = build("auto", "disaggregated")
    assert isinstance(nccl, DistributedTransport)
    assert (nccl.ranks_per_engine, nccl.engine_dtype, nccl.backend) == (2, "bfloat16", "nccl")
    disk = build("auto", "colocated")
    assert isinstance(disk, DiskTransport) and disk.name == "disk"
    assert disk.directory == (tmp_path / "run" / "engine_weights").resolve()
    assert (disk.directory / "config.json").is_file()  # a loadable HF directory once rank 0 adds the weights
    disk.close()
    assert not disk.directory.exists()
    assert isinstance(build("disk", "disaggregated"), DiskTransport)
    assert isinstance(build("distributed", "colocated"), DistributedTransport)


# ---- the one pause → update → continue routine ---------------------------------------------------------------


def test_paused_update_runs_while_paused_and_continues_even_when_the_update_fails(checkpoints):  # noqa: F811
    from rollout.client import EngineClient  # noqa: PLC0415
    from slime_dsa.orchestrator.weight_sync.base import WeightUpdateRefusedError  # noqa: PLC0415

    with serving(checkpoints[0]) as srv:
        engine = _engine(srv)
        paused_during: list[bool] = []

        async def scenario():
            async with EngineClient([srv.url]) as client:
                async def update() -> str:
                    paused_during.append(engine.engine.paused)
                    return "updated"

                assert await paused_update(client, update, "retract") == "updated"
                assert not engine.engine.paused

                async def failing() -> None:
                    paused_during.append(engine.engine.paused)
                    await post_update(client, "/update_weights_from_disk", {"model_path": "/no/such/dir"})

                refused = "/update_weights_from_disk failed on 1 of 1 engines.*not in a directory this server may load"
                with pytest.raises(WeightUpdateRefusedError, match=refused):
                    await paused_update(client, failing)
                assert not engine.engine.paused  # continued after the failure
                out = await client.generate([1, 2, 3], {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
                assert out["meta_info"]["completion_tokens"] == 2

        asyncio.run(asyncio.wait_for(scenario(), 120))
        assert paused_during == [True, True]


def test_a_dead_engine_is_dropped_and_the_update_goes_on_with_the_rest(checkpoints):  # noqa: F811
    """Issue 21: the pause reached a dead engine and the whole weight sync raised. Now the dead engine is lost (dropped,
    its listeners told) and the live one is paused, updated and continued; with none left, NoEnginesLeftError."""
    from rollout.client import EngineClient, NoEnginesLeftError  # noqa: PLC0415

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with serving(checkpoints[0]) as srv:
        engine = _engine(srv)
        called: list[bool] = []
        lost: list[str] = []

        async def scenario():
            async with EngineClient([srv.url, dead]) as client:
                client.on_engine_lost(lambda url, reason: lost.append(url))

                async def update() -> str:
                    called.append(engine.engine.paused)
                    return "updated"

                assert await paused_update(client, update, "retract") == "updated"
                assert list(client.engines) == [srv.url]
            async with EngineClient([dead]) as alone:
                with pytest.raises(NoEnginesLeftError, match="every engine was lost"):
                    await paused_update(alone, update, "retract")

        asyncio.run(asyncio.wait_for(scenario(), 120))
        assert called == [True] and not engine.engine.paused and lost == [dead]


def test_a_staged_replacement_is_paused_and_joins_at_the_update(checkpoints):  # noqa: F811
    from rollout.client import EngineClient  # noqa: PLC0415

    with serving(checkpoints[0]) as old, serving(checkpoints[0]) as new:
        paused_during: list[bool] = []

        async def scenario():
            async with EngineClient([old.url]) as client:
                client.stage_engine(new.url)
                assert list(client.engines) == [old.url]  # nothing routes to it before it has the weights

                async def update() -> None:
                    assert list(client.engines) == [old.url, new.url]
                    paused_during.append(_engine(new).engine.paused)

                await paused_update(client, update, "in_place")
                assert client.staged == []

        asyncio.run(asyncio.wait_for(scenario(), 120))
        assert paused_during == [True] and not _engine(new).engine.paused


def test_post_update_raises_on_a_success_false_reply():
    class Client:  # FAKE: two engines, one of which answers 200 with {"success": false}
        async def broadcast(self, path, body, **options):
            return {"http://a": {"success": True}, "http://b": {"success": False, "message": "bad tensor w"}}

    refused = r"/update_weights_from_disk failed on 1 of 2 engines: http://b \(bad tensor w\)"
    with pytest.raises(RuntimeError, match=refused):
        asyncio.run(post_update(Client(), "/update_weights_from_disk", {}))


# ---- transports into a real embedded server -------------------------------------------------------------------


def _transport(kind: str, client, trainer, model_dir: Path, tmp_path: Path):
    if kind == "http":
        return HttpTransport(client, trainer, bucket_bytes=200_000)
    if kind == "shm":
        return DiskTransport.in_shm(client, trainer, model_dir)
    return DiskTransport.in_directory(client, trainer, model_dir, tmp_path / "run" / "engine_weights")


@pytest.mark.parametrize("kind", ["http", "shm", "disk"])
def test_push_puts_the_trainers_weights_into_the_engine(checkpoints, trainer, kind, tmp_path):  # noqa: F811
    from rollout.client import EngineClient  # noqa: PLC0415

    if kind == "shm" and not SHM_ROOT.is_dir():
        pytest.skip("no /dev/shm on this machine")
    expected = trainer.full_state_dict()
    with serving(checkpoints[0], weight_dirs=[str(SHM_ROOT), str(tmp_path)]) as srv:
        engine = _engine(srv)
        before = engine.engine.model.state_dict()
        assert any(not torch.equal(before[k], expected[k]) for k in expected)  # the two checkpoints differ

        async def push():
            client = EngineClient([srv.url])
            sync = _transport(kind, client, trainer, checkpoints[1], tmp_path)
            try:
                state = await sync.push(7, pause_mode="retract", want_state=True)
                directory = getattr(sync, "directory", None)
                if directory is not None:
                    assert (directory / "model.safetensors").is_file() and (directory / "config.json").is_file()
                    assert not list(directory.glob("*.tmp*"))  # written atomically: no leftovers
            finally:
                sync.close()
                await client.close()
            return state, directory

        state, directory = asyncio.run(push())
        after = engine.engine.model.state_dict()
        assert set(state) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(after[name], tensor), name
            assert torch.equal(state[name], tensor), name
        assert engine.weight_version == "7"
        assert not engine.engine.paused  # generation continued after the update
    if directory is not None:
        assert not directory.exists()  # close() freed the directory (in /dev/shm: memory)


def test_weights_hook_gets_the_state_at_every_or_only_the_last_version():
    """hook_state "last": the push reads the weights back (want_state) only for the last version; the hook still
    runs at every version, with None before the last."""
    from types import SimpleNamespace

    from slime_dsa.orchestrator.step import Run, sync_weights

    class FakeWeights:
        def __init__(self) -> None:
            self.asked: list[bool] = []

        async def push(self, version: int, pause_mode: str = "abort", want_state: bool = False) -> dict | None:
            self.asked.append(want_state)
            return {"version": version} if want_state else None

    recipe = SimpleNamespace(trainer=SimpleNamespace(num_steps=3))
    for hook_state, wanted in (("every", [True, True, True, True]), ("last", [False, False, False, True])):
        seen: list = []
        run = Run(recipe, None, None, None, None, None, None, None, None, FakeWeights(), 0,
                  lambda v, s: seen.append((v, s)), hook_state)
        assert [run.hook_wants_state(v) for v in range(4)] == wanted
        for version in range(1, 4):
            asyncio.run(sync_weights(run.weights, version, on_weights=run.on_weights,
                                     want_state=run.hook_wants_state(version)))
        assert run.weights.asked == wanted[1:]
        assert seen == [(v, {"version": v} if w else None) for v, w in zip(range(1, 4), wanted[1:])]
    quiet = FakeWeights()  # no hook: never a read-back, whatever want_state says
    asyncio.run(sync_weights(quiet, 1, want_state=True))
    assert quiet.asked == [False]


def test_cuda_ipc_push_sends_rank_0s_table_between_pause_and_continue():
    class Trainers:  # FAKE: CUDA IPC needs a GPU (the real path: test_cuda_ipc.py)
        def share_weights(self, engine_dtype):
            return {"buffer": {"dtype_asked": engine_dtype}, "tensors": []}

    class Client:  # FAKE: records the calls
        engines = {"e": None}
        staged: list = []
        calls: list = []

        def admit_staged(self):
            return []

        async def broadcast(self, path, body, **options):
            self.calls.append((path, body))
            return {"e": {"success": True}}

    client = Client()
    sync = CudaIpcTransport(client, Trainers(), engine_dtype="bfloat16")
    assert asyncio.run(sync.push(4, pause_mode="retract")) is None
    assert [path for path, _ in client.calls] == ["/pause_generation", "/update_weights_from_tensor", "/continue_generation"]
    assert client.calls[0][1] == {"mode": "retract"}
    assert client.calls[1][1] == {"serialized_named_tensors": [{"buffer": {"dtype_asked": "bfloat16"}, "tensors": []}],
                                  "load_format": "cuda_ipc", "flush_cache": True, "weight_version": "4"}


# ---- distributed: gloo against a FAKE SGLang weight receiver ---------------------------------------------------

FAKE_RECEIVER = textwrap.dedent('''
    """FAKE SGLang weight receiver (NOT SGLang): serves /init_weights_update_group, /update_weights_from_distributed,
    /pause_generation and /continue_generation with SGLang's payloads, and joins the group the way SGLang's worker
    does (rank = rank_offset), receiving each broadcast in `names` order. Writes the calls it got to OUT.json and
    the tensors of the last update to OUT.safetensors."""
    import asyncio, json, sys
    import torch, torch.distributed as dist
    from aiohttp import web
    from safetensors.torch import save_file
    from trainers.process_group import init_weight_update_group

    port, out = int(sys.argv[1]), sys.argv[2]
    state = {"calls": [], "tensors": {}}

    def record(call):
        state["calls"].append(call)
        with open(out + ".json", "w") as f:
            json.dump(state["calls"], f)

    async def init_group(request):
        p = await request.json()
        state["group"] = await asyncio.to_thread(
            init_weight_update_group, p["master_address"], p["master_port"], p["world_size"],
            rank=p["rank_offset"], group_name=p["group_name"], backend=p["backend"])
        record({"path": "init", "world_size": p["world_size"], "rank_offset": p["rank_offset"]})
        return web.json_response({"success": True, "message": "ok"})

    async def update(request):
        p = await request.json()
        def recv():
            for name, dtype, shape in zip(p["names"], p["dtypes"], p["shapes"]):
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                dist.broadcast(t, src=0, group=state["group"])
                state["tensors"][name] = t
        await asyncio.to_thread(recv)
        if p["weight_version"] is not None:
            save_file(state["tensors"], out + ".safetensors")
        record({"path": "update", "names": p["names"], "version": p["weight_version"], "flush": p["flush_cache"]})
        return web.json_response({"success": True, "message": "ok"})

    async def pause(request):
        record({"path": "pause", "mode": (await request.json()).get("mode")})
        return web.json_response({"message": "ok", "status": "ok"})

    async def resume(request):
        record({"path": "continue"})
        return web.json_response({"message": "ok", "status": "ok"})

    async def health(request):
        return web.Response()

    app = web.Application(client_max_size=2**30)
    app.router.add_post("/init_weights_update_group", init_group)
    app.router.add_post("/update_weights_from_distributed", update)
    app.router.add_post("/pause_generation", pause)
    app.router.add_post("/continue_generation", resume)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None)
''')


@contextlib.contextmanager
def fake_sglang_receiver(tmp_path: Path):
    """FAKE_RECEIVER in a subprocess on a free loopback port: (its URL, the path prefix of what it received)."""
    from rollout.sglang.launcher import http_ok  # noqa: PLC0415

    script, out = tmp_path / "fake_receiver.py", str(tmp_path / "received")
    script.write_text(FAKE_RECEIVER)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, str(script), str(port), out], env=env)
    try:
        deadline = time.monotonic() + 60
        while not http_ok(f"{url}/health") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert http_ok(f"{url}/health"), "the fake receiver did not start"
        yield url, out
    finally:
        proc.terminate()
        proc.wait(10)


def test_distributed_push_over_gloo_to_a_fake_sglang_receiver(trainer, tmp_path):
    from safetensors.torch import load_file  # noqa: PLC0415

    from rollout.client import EngineClient  # noqa: PLC0415
    from trainers.weight_sender import engine_dtypes  # noqa: PLC0415

    with fake_sglang_receiver(tmp_path) as (url, out):
        async def run() -> DistributedTransport:
            async with EngineClient([url]) as client:
                sync = DistributedTransport(client, trainer, ranks_per_engine=1, engine_dtype="bfloat16",
                                            backend="gloo", bucket_bytes=50_000, group_name="test_group")
                assert await sync.push(1) is None
                await sync.push(2, pause_mode="retract")  # the group stays: no second init
                return sync

        sync = asyncio.run(asyncio.wait_for(run(), 180))
        calls = json.loads(Path(out + ".json").read_text())
        buckets = len(sync.buckets)
        assert buckets > 1
        assert [c["path"] for c in calls] == (["init", "pause"] + ["update"] * buckets + ["continue", "pause"]
                                              + ["update"] * buckets + ["continue"])
        assert calls[0] == {"path": "init", "world_size": 2, "rank_offset": 1}
        assert [c["mode"] for c in calls if c["path"] == "pause"] == ["abort", "retract"]
        updates = [c for c in calls if c["path"] == "update"][buckets:]
        # the version changes once, with the last bucket, which also flushes the cache
        assert [(c["version"], c["flush"]) for c in updates] == [(None, False)] * (buckets - 1) + [("2", True)]
        # every tensor arrived whole and in order, cast as a bf16 engine keeps it (routers, indexer head: float32)
        dtypes = engine_dtypes(trainer.policy.model.config, "bfloat16")
        expected = trainer.full_state_dict()
        assert [n for c in updates for n in c["names"]] == list(trainer.policy.model.state_dict())
        got = load_file(out + ".safetensors")
        assert set(got) == set(expected)
        for name, tensor in expected.items():
            assert got[name].dtype == dtypes[name] and torch.equal(got[name], tensor.to(dtypes[name])), name


def test_a_bf16_engine_gets_float32_routers_and_indexer_heads_unrounded(tmp_path):
    """What a transport hands a bf16 engine (http, shm and disk: the trainer's float32 state; distributed and
    cuda_ipc: each tensor cast to the dtype engine_dtypes gives it) leaves the engine's router weights, selection
    biases and indexer heads at the trainer's float32 values bit for bit, though bf16 cannot hold them."""
    from rollout.engine import Engine  # noqa: PLC0415
    from slime_dsa.checkpoint.hf_format import load_model  # noqa: PLC0415
    from tests.megatron_conformance import float32_tensors, save_bf16_checkpoint  # noqa: PLC0415
    from trainers.weight_sender import sent_tensors, weight_specs  # noqa: PLC0415

    save_bf16_checkpoint(tmp_path / "engine")  # the same weights, the float32 ones rounded to bf16 values
    save_bf16_checkpoint(tmp_path / "trainer", float32_router=True)
    master = load_model(tmp_path / "trainer", dtype=torch.float32)
    specs = weight_specs(master, "bfloat16")
    cast = dict(zip([s.name for s in specs], sent_tensors(master.state_dict(), specs)))
    kept = float32_tensors(tmp_path / "trainer")
    for sent in (master.state_dict(), cast):
        engine = Engine(load_model(tmp_path / "engine", dtype=torch.bfloat16).eval(), max_cache_tokens=64,
                        block_size=4)
        held = engine.model.state_dict()
        assert any(not torch.equal(held[name], value) for name, value in kept.items())
        engine.update_weights(sent, "1")
        assert held["lm_head.weight"].dtype == torch.bfloat16
        for name, value in kept.items():
            assert held[name].dtype == torch.float32 and torch.equal(held[name], value), name


def test_a_push_says_how_long_reading_the_state_back_took():
    """WeightTransport.push times the read-back for an on_weights hook apart (perf/weights_readback_s), so a benchmark
    can take it out of its step clock; 0 when no state was wanted."""
    import time

    from slime_dsa.orchestrator.weight_sync.base import WeightTransport

    class Client:
        engines = {"u": None}
        staged: list = []

        async def broadcast(self, path, json=None, **kwargs):
            return {"u": None}

        def admit_staged(self) -> list:
            return []

    class SlowRead(WeightTransport):
        async def update(self, version: int, prepared) -> None:
            pass

        async def read_state(self, prepared) -> dict:
            time.sleep(0.05)
            return {"w": version_seen}

    version_seen = 3
    transport = SlowRead(Client(), trainers=None)
    assert asyncio.run(transport.push(3, want_state=True)) == {"w": 3} and transport.last_read_s >= 0.05
    assert asyncio.run(transport.push(4)) is None and transport.last_read_s == 0.0
