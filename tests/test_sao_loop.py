"""SAO end to end on CPU through Ray: an embedded engine over loopback HTTP, FSDP2 ranks holding the policy and the
critic (colocated, or the critic on a rank of its own), the asynchronous loop at max_staleness 0 (so a resumed run
regenerates the same samples), then resume. Real parts throughout; the task is single-turn arithmetic (the agentic
tasks come from another branch; tests/test_sao.py covers multi-turn trajectories and bootstrapping).
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

from slime_dsa.config import load_recipe

pytestmark = pytest.mark.slow

RECIPE = {
    "model": {"preset": "tiny"},
    "data": {"tasks": [{"kind": "arithmetic", "reward_fn": "tests.plugins.rewards:digit_fraction"}],
             "apply_chat_template": True, "max_prompt_length": 96},
    "rollout": {"num_engines": 1, "n_samples_per_prompt": 1, "prompts_per_step": 8, "max_response_length": 8},
    "algorithm": {"name": "sao", "max_staleness": 0, "critic_warmup_steps": 1, "critic_updates_per_step": 2},
    "trainer": {"num_workers": 1, "num_steps": 3, "learning_rate": 3.0e-3, "micro_batch_tokens": 256},
    "critic": {"learning_rate": 1.0e-3},
    "logging": {"wandb_mode": "disabled"},
    "checkpoint": {"save_every": 1, "keep_last": 0},
}


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run(root, name, recipe, resume_from=None):
    from slime_dsa.orchestrator.train import run_training

    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run_dir = root / name
    if resume_from is not None:  # a fresh run directory holding one checkpoint of another run
        (run_dir / "checkpoints").mkdir(parents=True)
        shutil.copytree(resume_from, run_dir / "checkpoints" / resume_from.name)
        if (resume_from.parents[1] / "initial_model").is_dir():  # a from-scratch preset's starting weights
            shutil.copytree(resume_from.parents[1] / "initial_model", run_dir / "initial_model")
    return run_training(load_recipe(path, [f"logging.run_dir={run_dir}"]), resume=resume_from is not None)


@pytest.fixture(scope="module")
def sao_run(tmp_path_factory, ray_cluster):
    root = tmp_path_factory.mktemp("sao")
    return root, _run(root, "run", RECIPE)


def test_three_sao_steps_critic_first_then_k_to_one(sao_run):
    _, run_dir = sao_run
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["rollout/num_samples"] == 8 and r["rollout/num_groups_trained"] == 8  # one rollout per prompt
        assert math.isfinite(r["critic/value_loss"])
        assert math.isfinite(r.get("critic/explained_variance", 0.0))  # left out where every target is equal
        assert r["critic/steps"] == 2  # K = 2 passes of one optimiser step each
        for key in ("advantage/mean", "advantage/std", "advantage/lambda_mean", "advantage/lambda_min",
                    "advantage/lambda_max", "advantage/bootstrapped_frac"):
            assert math.isfinite(r[key]), key
        assert 0 < r["advantage/lambda_min"] <= r["advantage/lambda_max"] < 1
    warmup, *actor = records
    assert warmup["train/policy_steps"] == 0 and "train/loss" not in warmup  # the critic trains alone
    for r in actor:
        assert r["train/policy_steps"] == 1 and r["critic/steps"] == 2 * r["train/policy_steps"]
        assert math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0
        # The engine sampled with exactly the trainer's weights: the ratio π_θ / π_roll is 1 up to float noise.
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-5
        assert r["train/dis_frac_outside"] == r["train/dis_frac_below"] + r["train/dis_frac_above"]
    # Answers cut at max_response_length were scored by the reward function: ended episodes, never bootstrapped.
    assert any(r["rollout/truncated_frac"] > 0 for r in records)
    assert all(r["advantage/bootstrapped_frac"] == 0 for r in records)


def test_critic_warmup_leaves_the_policy_unchanged(sao_run):
    _, run_dir = sao_run
    initial = load_file(run_dir / "initial_model" / "model.safetensors")
    ckpts = run_dir / "checkpoints"
    after_warmup = load_file(ckpts / "step_000001" / "model.safetensors")
    assert after_warmup.keys() == initial.keys() and all(torch.equal(after_warmup[k], initial[k]) for k in initial)
    after_actor = load_file(ckpts / "step_000002" / "model.safetensors")
    assert any(not torch.equal(after_actor[k], initial[k]) for k in initial)  # then the actor moves
    critic = load_file(ckpts / "step_000001" / "critic" / "model.safetensors")
    dense = [k for k in critic if k.startswith("model.layers.0.mlp.")]  # every token reaches the dense MLP
    assert dense and all(not torch.equal(critic[k], initial[k]) for k in dense)  # the critic trained
    assert all(torch.equal(critic[k], initial[k]) for k in critic if ".self_attn." in k)  # frozen attention


def test_resume_reproduces_step_3_critic_included(sao_run):
    root, run_dir = sao_run
    resumed = _run(root, "resumed", RECIPE, resume_from=run_dir / "checkpoints" / "step_000002")
    step3 = next(r for r in _records(run_dir) if r["step"] == 3)
    (again,) = [r for r in _records(resumed) if r["step"] == 3]
    # The critic never reads the engines' log-probs: its numbers are bit-identical. The policy's loss does (DIS,
    # π_θ / π_roll), and the engine's log-probs vary at 1e-7 with how requests share a decode batch.
    for key, value in step3.items():
        if key.startswith(("critic/", "advantage/", "rollout/")) and not key.endswith("_time_s") \
                and not key.endswith("tok_s"):
            assert again[key] == value, key
        elif key.startswith("train/"):
            assert again[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    final, final_again = run_dir / "checkpoints" / "step_000003", resumed / "checkpoints" / "step_000003"
    critic, critic_again = load_file(final / "critic" / "model.safetensors"), load_file(final_again / "critic" / "model.safetensors")
    assert all(torch.equal(critic[k], critic_again[k]) for k in critic)
    policy, policy_again = load_file(final / "model.safetensors"), load_file(final_again / "model.safetensors")
    assert all(torch.allclose(policy[k], policy_again[k], rtol=0, atol=1e-6) for k in policy)


def test_critic_on_its_own_rank(tmp_path, ray_cluster):
    """critic.placement separate: the critic's rank trains while the policy's does; its files (RNG included) go
    under critic/, and a resumed run continues it exactly."""
    recipe = {**RECIPE, "algorithm": {**RECIPE["algorithm"], "critic_warmup_steps": 0},
              "trainer": {**RECIPE["trainer"], "num_steps": 2},
              "critic": {**RECIPE["critic"], "placement": "separate", "num_workers": 1}}
    run_dir = _run(tmp_path, "apart", recipe)
    records = _records(run_dir)
    assert [r["critic/steps"] for r in records] == [2, 2] and [r["train/policy_steps"] for r in records] == [1, 1]
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-5 for r in records)
    step1 = run_dir / "checkpoints" / "step_000001"
    assert (step1 / "rng_rank0.safetensors").exists() and (step1 / "critic" / "rng_rank0.safetensors").exists()
    resumed = _run(tmp_path, "apart_resumed", recipe, resume_from=step1)
    final = load_file(run_dir / "checkpoints" / "step_000002" / "critic" / "model.safetensors")
    again = load_file(resumed / "checkpoints" / "step_000002" / "critic" / "model.safetensors")
    assert all(torch.equal(final[k], again[k]) for k in final)
