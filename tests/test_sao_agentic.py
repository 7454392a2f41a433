"""SAO on the built-in agentic task end to end on CPU: multi-turn trajectories of the tool-calling asset model with
real tools (calculator), one embedded engine, an FSDP2 rank holding policy and critic; 3 steps (a critic-only first),
then resume from step 2."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.test_sao_loop import _records, _run

ASSET = Path(__file__).resolve().parent / "assets" / "agent-tiny"
pytestmark = pytest.mark.slow

RECIPE = {
    "model": {"path": str(ASSET)},
    "data": {"tasks": [{"kind": "calc_chain", "train_size": 64,
                        "agent": {"tools": ["calculator"], "max_turns": 4, "max_turn_tokens": 48}}],
             "apply_chat_template": True, "max_prompt_length": 96},
    "rollout": {"num_engines": 1, "n_samples_per_prompt": 1, "prompts_per_step": 4, "max_response_length": 160},
    "algorithm": {"name": "sao", "max_staleness": 0, "critic_warmup_steps": 1},
    "trainer": {"num_workers": 1, "num_steps": 3, "learning_rate": 1.0e-4, "micro_batch_tokens": 512},
    "critic": {"learning_rate": 5.0e-4},
    "logging": {"wandb_mode": "disabled"},
    "checkpoint": {"save_every": 1, "keep_last": 0},
}


def test_sao_on_agent_trajectories_trains_and_resumes_exactly(tmp_path, ray_cluster):
    run_dir = _run(tmp_path, "run", RECIPE)
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["critic/steps"] == 2 and math.isfinite(r["critic/value_loss"]) for r in records)
    assert records[0]["train/policy_steps"] == 0
    # Tool output is in the trajectories (response tokens the model did not generate), out of GAE and the losses.
    assert any(r["rollout/generated_tokens"] < r["rollout/response_length_mean"] * r["rollout/num_samples"]
               for r in records)
    for r in records[1:]:
        assert r["train/policy_steps"] == 1 and math.isfinite(r["train/loss"])
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-5  # tool tokens masked, model tokens matched
    resumed = _run(tmp_path, "resumed", RECIPE, resume_from=run_dir / "checkpoints" / "step_000002")
    (again,) = [r for r in _records(resumed) if r["step"] == 3]
    step3 = records[2]
    assert all(again[k] == v for k, v in step3.items() if k.startswith(("critic/", "advantage/")))
    final = load_file(run_dir / "checkpoints" / "step_000003" / "critic" / "model.safetensors")
    final_again = load_file(resumed / "checkpoints" / "step_000003" / "critic" / "model.safetensors")
    assert all(torch.equal(final[k], final_again[k]) for k in final)
