"""The RL loop with trainer.backend deepspeed on CPU: 3 GRPO steps, 2 embedded engines, 2 ZeRO-3 ranks (every parameter
partitioned, optimizer state in host memory), weight sync from the gathered partitions after every step, then an
exact resume from the step-2 checkpoint. Real parts: a local Ray cluster, engines behind HTTP on 127.0.0.1, DeepSpeed
over gloo."""

from __future__ import annotations

import json
import math

import pytest

from tests.test_deepspeed_conformance import needs_deepspeed
from tests.test_rl_loop import RECIPE, _records, assert_equal_but_engine_noise, rerun_from_step_2, train_recipe

pytestmark = [pytest.mark.slow, needs_deepspeed]  # Ray and rank processes

DEEPSPEED = {**RECIPE, "trainer": {**RECIPE["trainer"], "backend": "deepspeed",
                                   "deepspeed": {"zero_stage": 3, "param_persistence_threshold": 0,
                                                 "offload_optimizer": "cpu"}},
             "logging": {"eval_every": 0, "wandb_mode": "disabled"}}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, ray_cluster):
    root = tmp_path_factory.mktemp("ds_rl")
    return root, train_recipe(root, DEEPSPEED)


def test_three_grpo_steps_train_and_sync(first_run):
    from safetensors.torch import load_file

    _, run_dir = first_run
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0
        # The engines sampled with exactly the weights the ZeRO-3 ranks hold: the gathered sync after every step.
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-5
    initial = load_file(run_dir / "initial_model" / "model.safetensors")
    final = load_file(run_dir / "checkpoints" / "step_000003" / "model.safetensors")
    assert final.keys() == initial.keys()
    changed = [k for k in initial if not (initial[k] == final[k]).all()]
    assert len(changed) > len(initial) // 2, f"only {len(changed)} tensors changed"
    assert json.loads((run_dir / "checkpoints" / "step_000003" / "trainer.json").read_text())["step"] == 6


def test_resume_from_step_2_reproduces_step_3(first_run):
    step3, again, _ = rerun_from_step_2(*first_run)
    assert len(again) == 1
    assert_equal_but_engine_noise(again[0], step3)
