"""The whole RL loop on CPU with trainer.backend megatron: 3 GRPO steps, 2 embedded engines, 2 Megatron ranks (expert
parallel 2) over gloo, weight sync after every step, checkpoints, an exact resume and an export transformers loads."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from tests.test_rl_loop import (RECIPE, _records, assert_equal_but_engine_noise, export_step_3, rerun_from_step_2,
                                 train_recipe)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                 reason="megatron-core is not installed (pip install -e '.[megatron]', Python >= 3.12)")]
MEGATRON = {**RECIPE, "trainer": {**RECIPE["trainer"], "backend": "megatron", "megatron": {"expert_parallel": 2}}}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, ray_cluster):
    root = tmp_path_factory.mktemp("megatron_rl")
    return root, train_recipe(root, MEGATRON)


def test_three_grpo_steps_stay_in_sync(first_run):
    from safetensors.torch import load_file

    _, run_dir = first_run
    _, *records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-5  # the engines hold exactly the trainer's weights
    initial = load_file(run_dir / "initial_model" / "model.safetensors")
    final = load_file(run_dir / "checkpoints" / "step_000003" / "model.safetensors")
    assert final.keys() == initial.keys()
    assert sum(not torch.equal(initial[k], final[k]) for k in initial) > len(initial) // 2


def test_resume_from_step_2_reproduces_step_3(first_run):
    step3, again, _ = rerun_from_step_2(*first_run)
    assert len(again) == 1
    assert_equal_but_engine_noise(again[0], step3)


def test_export_loads_in_transformers(first_run, tmp_path):
    hf, ours, _ = export_step_3(first_run[1], tmp_path)
    ids = torch.tensor([[5, 17, 3, 9, 11]])
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids).logits).abs().max().item() < 1e-4
