"""GRPO on an agentic task end to end on CPU: Ray, an embedded engine behind HTTP, real tools, FSDP2 over gloo.
Each group is n multi-turn trajectories of the tool-calling asset model (tests/assets/agent-tiny)."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from slime_dsa.config import load_recipe
from tests.agent_model import ASSET

RECIPE = {
    "model": {"path": str(ASSET)},
    "data": {"tasks": [{"kind": "calc_chain", "eval_size": 2, "train_size": 64,
                        "agent": {"tools": ["calculator"], "max_turns": 4, "max_turn_tokens": 48}}],
             "apply_chat_template": True, "max_prompt_length": 96},
    "rollout": {"num_engines": 1, "n_samples_per_prompt": 4, "prompts_per_step": 2, "max_response_length": 160},
    "trainer": {"num_workers": 1, "num_steps": 2, "learning_rate": 1.0e-4, "micro_batch_tokens": 512},
    "logging": {"eval_every": 2, "wandb_mode": "offline"},
}


@pytest.mark.slow
def test_grpo_trains_on_agent_trajectories(tmp_path, ray_cluster):
    from slime_dsa.orchestrator.train import run_training

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(RECIPE))
    run_dir = run_training(load_recipe(path, [f"logging.run_dir={tmp_path / 'run'}"]))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert math.isfinite(r["train/loss"]) and r["rollout/num_samples"] == 8
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-5  # tool tokens masked, model tokens matched
    assert "eval/calc_chain/pass@1" in records[-1]
