"""The trainer interface over Ray: build_trainer_group(recipe) starts the recipe's backend, and the group's calls
(log-probs, a training step with π_old, weights, checkpoints, memory) fan out to every rank and gather in batch
order. Real parts: a local Ray cluster, two FSDP2 ranks over gloo."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.hf_reference import make_hf_checkpoint
from tests.test_data_parallel import _batch
from trainers.process_group import free_port


@pytest.mark.slow
def test_group_calls_reach_every_rank_in_batch_order(tmp_path, ray_cluster):
    from slime_dsa.algorithms.specs import build_algorithm
    from slime_dsa.config import validate_recipe
    from trainers.factory import build_trainer_group, rank_config
    from trainers.fsdp.worker import FSDPWorker

    make_hf_checkpoint(tmp_path / "ckpt", index_topk=4)
    recipe = validate_recipe({"trainer": {"num_workers": 2, "data_parallel": "replicate", "learning_rate": 1e-2,
                                          "micro_batch_tokens": 64},
                              "data": {"max_prompt_length": 32}, "rollout": {"max_response_length": 32},
                              "model": {"ops_backend": "torch"}})
    algorithm = build_algorithm(recipe.algorithm)
    config = rank_config(recipe, tmp_path / "ckpt", algorithm)
    single = FSDPWorker(0, 1, "127.0.0.1", free_port(), config)  # the whole batch on one rank, in this process
    batch = _batch()
    expected = single.compute_logprobs(batch)
    single.shutdown()

    group = build_trainer_group(recipe, tmp_path / "ckpt", algorithm)
    try:
        assert group.world_size == 2
        torch.testing.assert_close(group.compute_logprobs(batch), expected, rtol=0, atol=1e-5)
        old, metrics = group.train(batch, num_mini_batches=1, recompute_old_logprobs=True)
        torch.testing.assert_close(old, expected, rtol=0, atol=1e-5)  # π_old: the weights before the update
        assert metrics["grad_norm"] > 0 and metrics["lr"] == 1e-2
        group.release_memory()
        group.resume_memory()
        trained = group.full_state_dict()
        group.save_weights(str(tmp_path / "w.safetensors"))
        saved = load_file(tmp_path / "w.safetensors")
        assert all(torch.equal(saved[k], v) for k, v in trained.items())
        group.save_checkpoint(str(tmp_path / "step"))
        group.train(batch, recompute_old_logprobs=True)  # move away, then back
        group.load_checkpoint(str(tmp_path / "step"))
        assert all(torch.equal(group.full_state_dict()[k], v) for k, v in trained.items())
    finally:
        group.shutdown()
