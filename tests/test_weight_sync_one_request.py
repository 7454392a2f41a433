"""The weight update as one request per embedded engine (issue 19): the engine pauses, updates and continues in one
command between two of its steps, so a push costs one HTTP request per engine where it cost three (pause, update,
continue), and the colocated synchronous step sends no continue of its own before the push."""

from __future__ import annotations

import asyncio

import pytest
import torch

from slime_dsa.orchestrator.weight_sync import SHM_ROOT, DiskTransport
from tests.fake_step_run import FakeStepRun
from tests.test_server import checkpoints, serving  # noqa: F401 (checkpoints is a fixture)
from tests.test_weight_sync import _engine, trainer  # noqa: F401 (trainer is a fixture)


def _front():
    from rollout.engine import Engine
    from rollout.engine.async_engine import AsyncEngine
    from tests.test_perf_metrics import _tiny_model

    return AsyncEngine(Engine(_tiny_model(), max_cache_tokens=1024, max_running_requests=8, seed=0))


def _shifted(front) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() + 0.01 for k, v in front.engine.model.state_dict().items()}


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
def test_an_update_with_a_pause_mode_is_one_command_and_leaves_the_engine_running(mode):
    from rollout.engine import GenerateRequest, SamplingParams

    front = _front()
    new = _shifted(front)

    async def scenario():
        await front.start()
        params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
        outputs = []

        async def consume():
            async for out in front.generate(GenerateRequest(input_ids=[5, 6, 7], sampling=params, rid="r")):
                outputs.append(out)
        task = asyncio.create_task(consume())
        while len(outputs) < 3:  # a few tokens under version 0
            await asyncio.sleep(0.001)
        submitted = []
        submit = front._submit
        front._submit = lambda fn, future=None: (submitted.append(fn), submit(fn, future))
        await front.update_weights(new, "5", pause_mode=mode)
        front._submit = submit
        await asyncio.wait_for(task, 60)
        await front.stop()
        return outputs[-1], len(submitted)

    last, commands = asyncio.run(scenario())
    assert commands == 1  # pause, update and continue: one command, no step between them
    assert not front.engine.paused and front.weight_version == "5"
    for name, tensor in new.items():
        assert torch.equal(front.engine.model.state_dict()[name], tensor), name
    if mode == "abort":
        assert last.finish_reason["type"] == "abort"
    else:  # partial rollouts go on under the new weights; each token says which version produced it
        assert last.finish_reason["type"] == "length" and len(last.output_ids) == 40
        versions = last.output_token_versions
        assert versions[0] == 0 and versions[-1] == 5 and versions == sorted(versions)


def test_a_failed_update_with_a_pause_mode_still_continues_and_changes_nothing():
    from rollout.engine.types import RequestError

    front = _front()
    bad = {"no.such.tensor": torch.zeros(2)}

    async def scenario():
        await front.start()
        try:
            with pytest.raises(RequestError, match="no.such.tensor"):
                await front.update_weights(bad, "9", pause_mode="retract")
        finally:
            await front.stop()

    asyncio.run(scenario())
    assert not front.engine.paused and front.weight_version == "0"


def test_the_server_refuses_an_unknown_pause_mode_and_updates_nothing(checkpoints):  # noqa: F811
    from tests.test_server import post

    with serving(checkpoints[0], weight_dirs=[str(checkpoints[1])]) as srv:
        status, body = post(srv, "/update_weights_from_disk", {"model_path": str(checkpoints[1]), "pause_mode": "nap"},
                            headers={})
        assert status == 400 and "pause_mode" in str(body)
        assert _engine(srv).weight_version == "0"
        status, body = post(srv, "/update_weights_from_disk", {"model_path": str(checkpoints[1]), "pause_mode": "abort",
                                                               "weight_version": "3"}, headers={})
        assert status == 200 and body["success"] is True
        assert _engine(srv).weight_version == "3" and not _engine(srv).engine.paused


class _Recorded:
    """Wraps an EngineClient: every broadcast and post_to path, in order."""

    def __init__(self, client) -> None:
        self.paths: list[str] = []
        self.bodies: list = []
        broadcast, post_to = client.broadcast, client.post_to

        async def recorded_broadcast(path, json=None, **options):
            self.paths.append(path)
            self.bodies.append(json)
            return await broadcast(path, json, **options)

        async def recorded_post_to(url, path, json=None, **options):
            self.paths.append(f"{path} (staged)")
            return await post_to(url, path, json, **options)
        client.broadcast, client.post_to = recorded_broadcast, recorded_post_to


@pytest.mark.skipif(not SHM_ROOT.is_dir(), reason="no /dev/shm on this machine")
def test_a_push_to_embedded_engines_is_one_request_each_with_the_weights_equal_after(checkpoints, trainer):  # noqa: F811
    from rollout.client import EngineClient

    expected = trainer.full_state_dict()
    with serving(checkpoints[0], weight_dirs=[str(SHM_ROOT)]) as srv, \
            serving(checkpoints[0], weight_dirs=[str(SHM_ROOT)]) as staged:

        async def push():
            client = EngineClient([srv.url])
            client.stage_engine(staged.url)  # a replacement joins at this update
            calls = _Recorded(client)
            sync = DiskTransport.in_shm(client, trainer, checkpoints[1])
            sync.engines_pause = True
            try:
                await sync.push(7, pause_mode="retract")
            finally:
                sync.close()
                await client.close()
            return calls, list(client.engines)

        calls, engines = asyncio.run(push())
        # The staged engine is paused before it joins (nothing may route to it before it holds v7); the live one
        # gets no pause and no continue of its own.
        assert calls.paths == ["/pause_generation (staged)", "/update_weights_from_disk"]
        assert calls.bodies[0]["pause_mode"] == "retract" and engines == [srv.url, staged.url]
        for server in (srv, staged):
            engine = _engine(server)
            for name, tensor in expected.items():
                assert torch.equal(engine.engine.model.state_dict()[name], tensor), name
            assert engine.weight_version == "7" and not engine.engine.paused


def test_build_weight_sync_lets_only_embedded_engines_pause_in_the_update(checkpoints, tmp_path, monkeypatch):  # noqa: F811
    from slime_dsa.config import validate_recipe
    from slime_dsa.orchestrator import weight_sync

    monkeypatch.setattr(weight_sync, "_embedded_or_external", lambda *a: ("http", None))
    for engine, pauses in (("embedded", True), ("external", False)):
        extra = {"engine_urls": ["http://127.0.0.1:1"]} if engine == "external" else {}
        recipe = validate_recipe({"rollout": {"engine": engine, **extra}})
        assert weight_sync.build_weight_sync(recipe, None, None, [], checkpoints[1], tmp_path).engines_pause is pauses


def test_the_colocated_sync_step_leaves_the_continue_to_the_push(monkeypatch):
    """The synchronous loop's step: after training the colocated engines stay paused (to_engines sends no continue),
    and the push that follows continues them in its one update request."""
    from slime_dsa.orchestrator import train
    from slime_dsa.orchestrator.colocation import MemoryHandOver
    from slime_dsa.orchestrator.weight_sync import CudaIpcTransport

    calls: list[str] = []

    class Client:  # FAKE: one engine that keeps its KV cache; records the control calls
        engines = {"e": None}
        staged: list = []

        def admit_staged(self):
            return []

        async def broadcast(self, path, body=None, **options):
            calls.append(f"{path} {body.get('mode') or body.get('pause_mode') or ''}".strip())
            return {"e": {"success": True}}

    class Trainers:  # FAKE
        def release_memory(self, min_free_share=None):
            calls.append("trainer release")

        def share_weights(self, dtype):
            calls.append("trainer share")
            return {}

    client, trainers = Client(), Trainers()
    hand_over = MemoryHandOver(client, trainers, "keep")
    weights = CudaIpcTransport(client, trainers, "bfloat16")
    weights.engines_pause = True

    async def train_on_samples(run, step, samples, resume_engines=True, clock=None, while_training=None):
        await hand_over.to_trainer()
        calls.append("train")
        await hand_over.to_engines(resume=resume_engines)
        return {}

    run = FakeStepRun(Client(), weights)
    monkeypatch.setattr(train, "train_on_samples", train_on_samples)
    asyncio.run(train._one_step(run, 0))
    assert calls == ["/pause_generation retract", "train", "trainer release", "trainer share",
                     "/update_weights_from_tensor abort"]


def test_the_engine_walks_its_modules_once_for_updates_and_again_after_its_weights_move():
    """update_weights uses a name -> tensor map built once (walking ~800 modules cost ~10 ms an update); a weights
    release and resume (the tensors may be new objects) rebuild it, and an update after them lands in the model."""
    front = _front()
    engine = front.engine
    first = engine.parameters_by_name()
    engine.update_weights(_shifted(front), "1")
    assert engine.parameters_by_name() is first
    engine.release_memory(["weights"])
    engine.resume_memory(["weights"])
    assert engine.parameters_by_name() is not first
    new = _shifted(front)
    engine.update_weights(new, "2")
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, new[name]), name


def test_an_update_refreshes_the_experts_stacked_copies():
    """The engine's foreach copy bumps each parameter's version, so the experts' stacked copies (what grouped-GEMM
    decoding reads) are rebuilt from the new weights, as the loop of copies made them."""
    from slime_dsa.models.glm_moe_dsa import Experts

    front = _front()
    experts = [m for m in front.engine.model.modules() if isinstance(m, Experts)]
    assert experts
    for module in experts:
        module.stacked()
    front.engine.update_weights(_shifted(front), "1")
    for module in experts:
        gate_up, down = module._stacked[1], module._stacked[2]
        for e, mlp in enumerate(module):
            assert torch.equal(gate_up[e], torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            assert torch.equal(down[e], mlp.down_proj.weight)
