"""cuda_ipc weight sync end to end: the engine's cast rule, a CPU server's clear refusals, the real IPC path on a GPU.

The table's own encoding and checks are tested in test_weight_formats.py.

The GPU test runs an embedded server in a second process on the same GPU; a real FSDPWorker trainer rank (bf16 mixed
precision, as recipes/gpu_single.yaml; on one rank it computes with a bf16 copy) shares its weights by CUDA IPC, and
the engine's tensors must then equal the trainer's, cast to the engine's dtypes, bit for bit.
"""

from __future__ import annotations

import copy
import json
import multiprocessing as mp
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from slime_dsa.weights.cuda_ipc import IpcBuffer, IpcWeights, layout
from tests.test_weight_formats import HANDLE, REF, ipc_table
from trainers.process_group import free_port


def test_engine_dtypes_follow_the_models_cast_rule():
    from slime_dsa.models import ModelConfig  # noqa: PLC0415
    from tests.test_engine_gpu import CONFIG  # noqa: PLC0415
    from trainers.weight_sender import engine_dtypes  # noqa: PLC0415

    dtypes = engine_dtypes(ModelConfig.from_dict(CONFIG), "bfloat16")
    assert dtypes["lm_head.weight"] == torch.bfloat16
    kept = {name for name, d in dtypes.items() if d == torch.float32}
    assert kept and all(".gate." in n or "indexer.weights_proj" in n for n in kept), kept
    with pytest.raises(ValueError, match="engine dtype must be one of"):
        engine_dtypes(ModelConfig.from_dict(CONFIG), "fp8")


def test_cpu_server_refuses_cuda_ipc_clearly(checkpoints):
    from tests.test_server import post, serving  # noqa: PLC0415

    good = {"load_format": "cuda_ipc", "weight_version": "5"}
    with serving(checkpoints[0]) as srv:
        status, reply = post(srv, "/update_weights_from_tensor", {**good, "serialized_named_tensors": [ipc_table()]},
                             headers={})
        assert status == 400 and "the model has no tensor of that name" in reply["message"], reply
        name = "model.embed_tokens.weight"
        tensors, nbytes = layout([(name, tuple(_engine_state(srv)[name].shape), "bfloat16")])
        table = IpcWeights(IpcBuffer("GPU-1", HANDLE, nbytes, 0, nbytes, REF, 0, None, False), tensors).to_json()
        status, reply = post(srv, "/update_weights_from_tensor", {**good, "serialized_named_tensors": [table]}, headers={})
        assert status == 400 and "needs an engine on a CUDA device; this one runs on cpu" in reply["message"], reply
        bad = ipc_table(ref_counter_offset=-2)
        status, reply = post(srv, "/update_weights_from_tensor", {**good, "serialized_named_tensors": [bad]}, headers={})
        assert status == 400 and "buffer.ref_counter_offset must be an integer >= 0" in reply["error"]["message"]
        status, reply = post(srv, "/update_weights_from_tensor", {**good, "serialized_named_tensors": ["x"]}, headers={})
        assert status == 400 and "must be a JSON object with buffer and tensors" in reply["error"]["message"]
        status, reply = post(srv, "/update_weights_from_tensor", {"load_format": "npz", "serialized_named_tensors": ["x"]},
                             headers={})
        assert status == 400 and "'safetensors_b64'" in reply["error"]["message"] and "'cuda_ipc'" in reply["error"]["message"]
        assert _get_json(srv.url + "/get_weight_version") == {"weight_version": "0"}


def test_engine_keeps_a_senders_buffer_mapped_while_its_handle_stays(checkpoints, monkeypatch):
    """An engine maps a sender's buffer once and reads every refill through the same views while the handle stays;
    a new handle's buffer replaces it; stopping unmaps it. FAKE: CUDA IPC needs a GPU, so open_buffer here hands
    out host buffers by handle (the GPU test below sends three versions through one real handle)."""
    import asyncio  # noqa: PLC0415

    import slime_dsa  # noqa: PLC0415
    from rollout.engine import AsyncEngine, Engine  # noqa: PLC0415
    from slime_dsa.weights import cuda_ipc  # noqa: PLC0415

    model = slime_dsa.load_model(checkpoints[0]).eval()
    start = {name: t.detach().clone() for name, t in model.state_dict().items()}
    tensors, nbytes = layout([(name, tuple(t.shape), cuda_ipc.dtype_name(t.dtype)) for name, t in start.items()])
    buffers: dict[bytes, torch.Tensor] = {}
    monkeypatch.setattr(cuda_ipc, "open_buffer", lambda buffer, device: buffers[buffer.handle])

    def sender(handle: bytes) -> tuple[torch.Tensor, IpcWeights]:
        buffers[handle] = flat = torch.zeros(nbytes, dtype=torch.uint8)
        return flat, IpcWeights(IpcBuffer("GPU-1", handle, nbytes, 0, nbytes, REF, 0, None, False), tensors)

    def refill(flat: torch.Tensor, scale: float) -> None:
        for name, view in cuda_ipc.views(flat, tensors).items():
            view.copy_(start[name] * scale)

    def assert_holds(scale: float) -> None:
        for name, t in model.state_dict().items():
            assert torch.equal(t, start[name] * scale), name

    async def main() -> None:
        engine = AsyncEngine(Engine(model, max_cache_tokens=512, block_size=4))
        await engine.start()
        flat, ipc = sender(HANDLE)
        for version, scale in enumerate((2.0, 3.0, 0.5), start=1):
            refill(flat, scale)
            await engine.update_weights_from_cuda_ipc(ipc, weight_version=str(version))
            assert_holds(scale)
        assert engine.ipc_opens == 1
        other, moved = sender(b"\x07" * len(HANDLE))  # the sender made a new buffer
        refill(other, 1.5)
        await engine.update_weights_from_cuda_ipc(moved, weight_version="4")
        assert_holds(1.5)
        assert engine.ipc_opens == 2 and engine._ipc.flat is other
        await engine.stop()
        assert engine._ipc is None

    asyncio.run(main())


def test_engine_checks_a_shared_buffer_by_its_runs_and_names_a_bad_tensor(checkpoints, monkeypatch):
    """The engine checks a cuda_ipc update's finiteness over the buffer's runs of one dtype (float_spans); a NaN in a
    tensor is still named and changes nothing, a NaN in the padding between slices updates as a clean buffer does.
    FAKE: open_buffer hands out a host buffer, as in the test above."""
    import asyncio  # noqa: PLC0415

    import slime_dsa  # noqa: PLC0415
    from rollout.engine import AsyncEngine, Engine  # noqa: PLC0415
    from rollout.engine.types import RequestError  # noqa: PLC0415
    from slime_dsa.weights import checks, cuda_ipc  # noqa: PLC0415

    model = slime_dsa.load_model(checkpoints[0]).eval()
    start = {name: t.detach().clone() for name, t in model.state_dict().items()}
    tensors, nbytes = layout([(name, tuple(t.shape), cuda_ipc.dtype_name(t.dtype)) for name, t in start.items()])
    flat = torch.zeros(nbytes, dtype=torch.uint8)
    monkeypatch.setattr(cuda_ipc, "open_buffer", lambda buffer, device: flat)
    ipc = IpcWeights(IpcBuffer("GPU-1", HANDLE, nbytes, 0, nbytes, REF, 0, None, False), tensors)
    views = cuda_ipc.views(flat, tensors)
    checked = []
    real_flags = checks._finite_flags
    monkeypatch.setattr(checks, "_finite_flags", lambda ts: checked.append(len(ts)) or real_flags(ts))
    padded = next(t for t in tensors if t.nbytes % cuda_ipc.ALIGN_BYTES)  # a slice followed by padding
    victim = tensors[len(tensors) // 2]

    async def main() -> None:
        engine = AsyncEngine(Engine(model, max_cache_tokens=512, block_size=4))
        await engine.start()
        for name, view in views.items():
            view.copy_(start[name] * 2)
        flat[padded.offset + padded.nbytes:padded.offset + padded.nbytes + 4] = 255  # a float32 NaN's bytes
        checked.clear()
        await engine.update_weights_from_cuda_ipc(ipc, weight_version="1")
        assert checked[0] < len(tensors) and len(checked) == 2  # the runs found the padding; then tensor by tensor
        views[victim.name].view(-1)[-1] = float("nan")
        checked.clear()
        with pytest.raises(RequestError, match=f"tensor {victim.name} holds NaN"):
            await engine.update_weights_from_cuda_ipc(ipc, weight_version="2")
        for name, t in model.state_dict().items():  # version 1's weights
            assert torch.equal(t, start[name] * 2), name
        views[victim.name].copy_(start[victim.name])
        flat[padded.offset + padded.nbytes:padded.offset + padded.nbytes + 4] = 0
        checked.clear()
        await engine.update_weights_from_cuda_ipc(ipc, weight_version="3")
        assert checked == [len(cuda_ipc.float_spans(flat, tensors))] and checked[0] < len(tensors) / 4
        await engine.stop()

    asyncio.run(main())


def test_server_parses_a_repeated_cuda_ipc_table_once():
    """The server keeps the last cuda_ipc entry and its checked table: an equal entry (every update of one sender)
    is not parsed again; a different one is, with its own errors."""
    from rollout.server.app import _parse_cuda_ipc  # noqa: PLC0415
    from rollout.server.state import ServerState  # noqa: PLC0415

    class Engine:  # what _parse_cuda_ipc asks of the engine: that it takes cuda_ipc updates
        update_weights_from_cuda_ipc = None

    st = ServerState(engine=Engine(), tokenizer=None, api_key=None, max_body_bytes=1, max_weight_body_bytes=1,
                     max_prompt_tokens=None, model_path=None, served_model_name="m")
    first = _parse_cuda_ipc(st, ipc_table())
    assert _parse_cuda_ipc(st, json.loads(json.dumps(ipc_table()))) is first
    moved = _parse_cuda_ipc(st, ipc_table(ref_counter_offset=4))
    assert moved is not first and moved.buffer.ref_counter_offset == 4
    from rollout.engine.types import RequestError  # noqa: PLC0415

    with pytest.raises(RequestError, match="ref_counter_offset must be an integer >= 0"):
        _parse_cuda_ipc(st, ipc_table(ref_counter_offset=-2))
    assert st.last_cuda_ipc[1] is moved


def _engine_state(srv) -> dict[str, torch.Tensor]:
    from rollout.server.app import STATE  # noqa: PLC0415

    return srv.server.runner.app[STATE].engine.engine.model.state_dict()


# ---- the real thing, on a GPU ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two checkpoints of one tiny architecture (seeds 0 and 1) with the GLM-style tokenizer."""
    from slime_dsa.data.tokenizer import MODEL_VOCAB_SIZE, build_tokenizer, save_tokenizer  # noqa: PLC0415
    from tests.hf_reference import make_hf_checkpoint  # noqa: PLC0415

    eos = build_tokenizer().eos_token_id
    dirs = {}
    for seed in (0, 1):
        d = tmp_path_factory.mktemp(f"ipc_model{seed}")
        make_hf_checkpoint(d, seed=seed, vocab_size=MODEL_VOCAB_SIZE, eos_token_id=eos)
        save_tokenizer(d)
        dirs[seed] = d
    return dirs


def _engine_process(model_dir: str, conn) -> None:
    """Serve `model_dir` in bf16 on this process's GPU; for each path received, write the engine's tensors there."""
    import asyncio  # noqa: PLC0415
    import threading  # noqa: PLC0415

    from safetensors.torch import save_file  # noqa: PLC0415

    from rollout.server.launch import EmbeddedServer, load_engine  # noqa: PLC0415

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(120)  # noqa: E731
    engine, tokenizer = load_engine(model_dir, dtype="bfloat16", device="cuda", max_cache_tokens=4096,
                                    max_running_requests=8)
    server = run(EmbeddedServer.start(engine, tokenizer, model_path=model_dir))
    conn.send(server.url)
    while (msg := conn.recv()) != "stop":
        state = engine.engine.model.state_dict()
        save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}, msg)
        conn.send("ok")
    run(server.stop())


def _post_json(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as resp:
        return json.loads(resp.read())


def _assert_engine_holds(trainer_state: dict[str, torch.Tensor], conn, path: Path) -> None:
    from safetensors.torch import load_file  # noqa: PLC0415

    conn.send(str(path))
    assert conn.poll(120) and conn.recv() == "ok"
    engine = load_file(str(path))
    assert set(engine) == set(trainer_state)
    for name, tensor in trainer_state.items():
        assert torch.equal(engine[name], tensor.to(engine[name].dtype)), name


def test_buffer_fill_keeps_the_ranks_live_tensors(checkpoints):
    """A one-rank FSDP2 model's tensors are whole on the rank: the fill walks the state dict once and keeps them, so
    every later fill reads the weights the optimizer updated in place (the GPU test sends three versions so)."""
    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from trainers.base import policy_config  # noqa: PLC0415
    from trainers.fsdp.worker import FSDPWorker  # noqa: PLC0415
    from trainers.shared_weights import SharedWeights  # noqa: PLC0415

    worker = FSDPWorker(0, 1, "127.0.0.1", free_port(), policy_config(str(checkpoints[0]), PPOLoss()))
    model = worker.policy.model
    shared = SharedWeights(model, "bfloat16", sender=False)  # the sources alone: no buffer (that needs a GPU)
    first = shared._sources(model)
    assert shared._sources(model) is first  # kept
    assert [name for name, _ in first] == list(model.state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5).add_(0.25)
    now = {name: full for name, full in SharedWeights(model, "bfloat16", sender=False)._sources(model)}
    for name, kept in shared._sources(model):
        assert torch.equal(kept, now[name]), name  # the kept tensors are the live ones
    shared.forget_sources()
    assert shared._sources(model) is not first


@pytest.mark.gpu
def test_cuda_ipc_updates_an_engine_in_another_process(checkpoints, tmp_path):
    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from trainers.base import policy_config  # noqa: PLC0415
    from trainers.fsdp.worker import FSDPWorker  # noqa: PLC0415
    from trainers.group import share_then_release  # noqa: PLC0415

    config = policy_config(str(checkpoints[1]), PPOLoss(), frozen=(".indexer.",), mixed_precision=True)
    worker = FSDPWorker(0, 1, "127.0.0.1", free_port(), config)
    assert worker.bf16_copies  # one mixed-precision rank computes with a bf16 copy, as in recipes/gpu_single.yaml
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_engine_process, args=(str(checkpoints[0]), child_conn), daemon=True)
    proc.start()
    try:
        assert conn.poll(300), "the engine process did not start"
        url = conn.recv()
        body = {"load_format": "cuda_ipc", "flush_cache": True}
        table = worker.share_weights("bfloat16")
        assert table["buffer"]["device_uuid"] == worker.cuda_device()
        status, reply = _post_json(url + "/update_weights_from_tensor",
                                   {**body, "serialized_named_tensors": [table], "weight_version": "1"})
        assert status == 200 and reply["success"], reply
        _assert_engine_holds(worker.full_state_dict(), conn, tmp_path / "v1.safetensors")

        with torch.no_grad():  # a new version through the same buffer and handle
            for p in worker.policy.model.parameters():
                p.mul_(1.5).add_(0.25)
        again = worker.share_weights("bfloat16")
        assert again["buffer"] == table["buffer"]
        # As the run sends it to embedded engines: pause, update and continue in this one request.
        status, reply = _post_json(url + "/update_weights_from_tensor", {**body, "serialized_named_tensors": [again],
                                                                        "weight_version": "2", "pause_mode": "abort"})
        assert status == 200 and reply["success"], reply
        _assert_engine_holds(worker.full_state_dict(), conn, tmp_path / "v2.safetensors")

        with torch.no_grad():  # the colocated step's one rank call: fill the buffer, then release cached memory
            for p in worker.policy.model.parameters():
                p.mul_(0.5)
        third = share_then_release(worker, "bfloat16")
        assert third["buffer"] == table["buffer"]
        status, reply = _post_json(url + "/update_weights_from_tensor", {**body, "serialized_named_tensors": [third],
                                                                        "weight_version": "3", "pause_mode": "abort"})
        assert status == 200 and reply["success"] and "stats_commands" in reply, reply  # the counters ride along
        _assert_engine_holds(worker.full_state_dict(), conn, tmp_path / "v3.safetensors")

        wrong_shape = copy.deepcopy(again)
        wrong_shape["tensors"][0]["shape"] = [1]
        other_gpu = copy.deepcopy(again)
        other_gpu["buffer"]["device_uuid"] = "GPU-00000000-0000-0000-0000-000000000000"
        for bad, message in ((wrong_shape, f"tensor {again['tensors'][0]['name']} has shape (1,)"),
                             (other_gpu, "is not this engine's GPU")):
            status, reply = _post_json(url + "/update_weights_from_tensor",
                                       {**body, "serialized_named_tensors": [bad], "weight_version": "4"})
            assert status == 400 and message in reply["message"], reply
        assert _get_json(url + "/get_weight_version") == {"weight_version": "3"}
        assert _get_json(url + "/get_server_info")["paused"] is False
    finally:
        conn.send("stop")
        proc.join(60)
        worker.shutdown()
