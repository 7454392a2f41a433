"""Weight sync out of ZeRO-3 partitions: two DeepSpeed ranks (Ray actors, gloo, every parameter partitioned) gather a
bucket at a time and rank 0 broadcasts it to a FAKE SGLang weight receiver (tests/test_weight_sync.py's, which joins
the group as SGLang's worker does); the file and driver transports get the same gathered tensors."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.hf_reference import make_hf_checkpoint
from tests.test_deepspeed_conformance import needs_deepspeed
from tests.test_weight_sync import fake_sglang_receiver

pytestmark = [pytest.mark.slow, needs_deepspeed]


@pytest.fixture(scope="module")
def zero3(tmp_path_factory, ray_cluster):
    from slime_dsa.algorithms.specs import build_algorithm
    from slime_dsa.config import validate_recipe
    from trainers.factory import build_trainer_group

    directory = tmp_path_factory.mktemp("ds_sync")
    make_hf_checkpoint(directory / "ckpt", index_topk=4)
    recipe = validate_recipe({"trainer": {"backend": "deepspeed", "num_workers": 2,
                                          "deepspeed": {"zero_stage": 3, "param_persistence_threshold": 0}},
                              "model": {"ops_backend": "torch"}})
    group = build_trainer_group(recipe, directory / "ckpt", build_algorithm(recipe.algorithm))
    yield group, directory
    group.shutdown()


def test_gathered_weights_are_the_checkpoints(zero3):
    group, directory = zero3
    expected = load_file(next((directory / "ckpt").glob("*.safetensors")))
    state = group.full_state_dict()
    assert state.keys() >= expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    group.save_weights(str(directory / "w.safetensors"))
    saved = load_file(directory / "w.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in state.items())


def test_distributed_push_broadcasts_every_bucket_from_rank_0(zero3, tmp_path):
    from rollout.client import EngineClient
    from slime_dsa.orchestrator.weight_sync import DistributedTransport
    from trainers.weight_sender import engine_dtypes

    group, _ = zero3
    with fake_sglang_receiver(tmp_path) as (url, out):
        async def run() -> DistributedTransport:
            async with EngineClient([url]) as client:
                sync = DistributedTransport(client, group, ranks_per_engine=1, engine_dtype="bfloat16",
                                            backend="gloo", bucket_bytes=50_000, group_name="ds_group")
                assert await sync.push(1) is None
                return sync

        sync = asyncio.run(asyncio.wait_for(run(), 180))
        assert len(sync.buckets) > 1
        calls = json.loads(Path(out + ".json").read_text())
        expected = group.full_state_dict()
        updates = [c for c in calls if c["path"] == "update"]
        assert [n for c in updates for n in c["names"]] == list(expected)  # state-dict order, every tensor once
        got = load_file(out + ".safetensors")
        from slime_dsa.models import ModelConfig

        dtypes = engine_dtypes(ModelConfig.from_pretrained(group.config.roles["policy"].model_path), "bfloat16")
        for name, tensor in expected.items():
            assert got[name].dtype == dtypes[name] and torch.equal(got[name], tensor.to(dtypes[name])), name
