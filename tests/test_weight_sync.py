"""Weight sync from a trainer rank to a real embedded server over 127.0.0.1: both transports, and the choice.

The trainer is a real FSDPWorker (world size 1, gloo) holding checkpoint 1; the server starts from checkpoint 0.
After a push, the engine must hold exactly the trainer's tensors and report the pushed version.
"""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch

from slime_dsa.orchestrator.weight_sync import SHM_ROOT, WeightSync, choose_transport
from tests.test_server import checkpoints, serving  # noqa: F401 (checkpoints is a fixture)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def trainer(checkpoints):  # noqa: F811
    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from trainers.base import policy_config  # noqa: PLC0415
    from trainers.fsdp.worker import FSDPWorker  # noqa: PLC0415

    config = policy_config(str(checkpoints[1]), PPOLoss(), frozen=(".indexer.",), ops_backend="torch")
    w = FSDPWorker(0, 1, "127.0.0.1", _free_port(), config)
    yield w
    w.shutdown()


def test_choose_transport(tmp_path):
    assert choose_transport("auto", "embedded", ["a", "a"], "a", 1000, shm_root=tmp_path) == "shm"
    assert choose_transport("auto", "embedded", ["a", "b"], "a", 1000, shm_root=tmp_path) == "http"
    assert choose_transport("auto", "external", [], "a", 1000, shm_root=tmp_path) == "http"
    assert choose_transport("auto", "sglang", ["a"], "a", 1000, shm_root=tmp_path) == "http"
    assert choose_transport("auto", "embedded", ["a"], None, 1000, shm_root=tmp_path) == "http"
    assert choose_transport("auto", "embedded", ["a"], "a", 10**18, shm_root=tmp_path) == "http"  # no room
    assert choose_transport("auto", "embedded", ["a"], "a", 1000, shm_root=tmp_path / "missing") == "http"
    assert choose_transport("http", "embedded", ["a"], "a", 1000, shm_root=tmp_path) == "http"
    assert choose_transport("shm", "external", [], None, 10**18, shm_root=tmp_path) == "shm"  # as asked
    with pytest.raises(ValueError, match="rollout.weight_sync 'shm'"):
        choose_transport("shm", "embedded", ["a"], "a", 1000, shm_root=tmp_path / "missing")
    with pytest.raises(ValueError, match="rollout.weight_sync"):
        choose_transport("disk", "embedded", ["a"], "a", 1000, shm_root=tmp_path)


def test_choose_transport_picks_cuda_ipc_only_on_the_trainers_gpu(tmp_path):
    def choose(setting="auto", kind="embedded", nodes=("a", "a"), devices=("G0", "G0"), trainer="G0"):
        return choose_transport(setting, kind, list(nodes), "a", 1000, shm_root=tmp_path,
                                engine_devices=list(devices), trainer_device=trainer)

    assert choose() == "cuda_ipc"
    assert choose(devices=("G0", "G1")) == "shm"  # same node, another GPU
    assert choose(devices=("G0", None)) == "shm"  # an engine on the CPU
    assert choose(trainer=None) == "shm"  # trainer on the CPU
    assert choose(nodes=("a", "b")) == "http"
    assert choose(kind="sglang") == "http"
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


def test_cuda_ipc_weight_sync_needs_the_engine_dtype(tmp_path):
    with pytest.raises(ValueError, match="cuda_ipc needs the engines' dtype"):
        WeightSync.create(None, None, "cuda_ipc", tmp_path)
    assert WeightSync.create(None, None, "cuda_ipc", tmp_path, engine_dtype="bfloat16").engine_dtype == "bfloat16"


@pytest.mark.parametrize("transport", ["http", "shm"])
def test_push_puts_the_trainers_weights_into_the_engine(checkpoints, trainer, transport):  # noqa: F811
    from rollout.client import EngineClient  # noqa: PLC0415
    from rollout.server.app import STATE  # noqa: PLC0415

    if transport == "shm" and not SHM_ROOT.is_dir():
        pytest.skip("no /dev/shm on this machine")
    expected = trainer.full_state_dict()
    with serving(checkpoints[0]) as srv:
        engine = srv.server.runner.app[STATE].engine
        before = engine.engine.model.state_dict()
        assert any(not torch.equal(before[k], expected[k]) for k in expected)  # the two checkpoints differ

        async def push():
            client = EngineClient([srv.url])
            sync = WeightSync.create(client, trainer, transport, checkpoints[1])
            try:
                state = await sync.push(7, pause_mode="retract", want_state=True)
                directory = sync.directory
                if transport == "shm":
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
    if transport == "shm":
        assert not directory.exists()  # close() freed the shared memory


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


def test_cuda_ipc_push_sends_rank_0s_table_between_pause_and_continue(tmp_path):
    class Trainers:
        def share_weights(self, engine_dtype):
            return {"buffer": {"dtype_asked": engine_dtype}, "tensors": []}

    class Client:
        engines = {"e": None}
        calls: list = []

        async def broadcast(self, path, body):
            self.calls.append((path, body))
            return {"e": {"success": True}}

    client = Client()
    sync = WeightSync.create(client, Trainers(), "cuda_ipc", tmp_path, engine_dtype="bfloat16")
    assert asyncio.run(sync.push(4, pause_mode="retract")) is None
    assert [path for path, _ in client.calls] == ["/pause_generation", "/update_weights_from_tensor", "/continue_generation"]
    assert client.calls[0][1] == {"mode": "retract"}
    assert client.calls[1][1] == {"serialized_named_tensors": [{"buffer": {"dtype_asked": "bfloat16"}, "tensors": []}],
                                  "load_format": "cuda_ipc", "flush_cache": True, "weight_version": "4"}
