"""Algorithm specs: what each registered algorithm declares, and one real RL step per algorithm through the loop
(Ray, embedded engines over loopback HTTP, an FSDP2 rank) with the advantage function and loss that ran, and their
inputs, recorded."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from slime_dsa.algorithms import (
    DISLoss,
    PPOLoss,
    gae,
    group_advantages,
    group_centered_advantages,
    length_adaptive_lambda,
    mixed_advantages,
    rewards_on_last_action,
)
from slime_dsa.algorithms.specs import ALGORITHMS, AdvantageInputs, build_algorithm
from slime_dsa.config import load_recipe, validate_recipe

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 0.0, 1.0, 1.0])
GROUPS = torch.tensor([0, 0, 0, 0, 7, 7, 7, 7])


def _spec(**algorithm):
    return build_algorithm(validate_recipe({"algorithm": algorithm}).algorithm)


def test_grpo_declares_the_sync_loop_and_builds_its_loss_from_the_recipe():
    spec = _spec(name="grpo", eps_clip_high=0.3, dual_clip_c=3.0, is_correction="icepop", icepop_beta=5.0)
    assert (spec.loop, spec.old_logprobs, spec.advantage_source, spec.roles) == ("sync", "recompute", "group", ("policy",))
    loss = spec.policy_loss()
    assert isinstance(loss, PPOLoss)
    assert (loss.eps_high, loss.dual_clip, loss.is_correction, loss.icepop_beta) == (0.3, 3.0, "icepop", 5.0)
    assert _spec(name="grpo", use_rollout_logprobs=True).old_logprobs == "rollout"
    out = spec.advantages(AdvantageInputs(REWARDS, GROUPS))
    assert torch.equal(out, group_advantages(REWARDS, group_ids=GROUPS))
    dr_grpo = _spec(name="grpo", advantage_std_normalize=False).advantages(AdvantageInputs(REWARDS, GROUPS))
    assert torch.equal(dr_grpo, group_centered_advantages(REWARDS, group_ids=GROUPS))


def test_async_reinforce_declares_the_async_loop_and_no_old_logprobs():
    spec = _spec(name="async_reinforce", dis_eps_low=0.8, dis_eps_high=3.0)
    assert (spec.loop, spec.old_logprobs, spec.advantage_source) == ("async", "none", "group")
    loss = spec.policy_loss()
    assert isinstance(loss, DISLoss) and (loss.eps_low, loss.eps_high) == (0.8, 3.0)
    out = spec.advantages(AdvantageInputs(REWARDS, GROUPS))
    assert torch.equal(out, group_centered_advantages(REWARDS, group_ids=GROUPS))


def test_spec_modules_stay_light():
    """recipe check validates algorithm names against the registry; importing it must not import torch."""
    import subprocess
    import sys

    code = "import sys, slime_dsa.config, slime_dsa.algorithms.specs; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def _critic_gae(record: dict) -> torch.Tensor:
    """SAO's advantages from the recorded per-token inputs: skip-observation GAE, γ = 1, λ = 1 - 1/(1.5·l)."""
    mask, index = torch.tensor(record["loss_mask"]), torch.tensor(record["sample_index"])
    values, final = torch.tensor(record["values"]), torch.tensor(record["final_values"])
    rewards = rewards_on_last_action(torch.tensor(record["rewards"]), mask, index)
    bootstrap = final * torch.tensor(record["truncated"])
    return gae(rewards, values, mask, index, 1.0, length_adaptive_lambda(mask, index, 1.5),
               bootstrap_values=bootstrap).advantages


def _teacher_advantages(record: dict) -> torch.Tensor:
    """OPD's advantages from the recorded inputs: −(log π_roll − log π_T) on taught tokens (docs/algorithms.md §7)."""
    rewards, groups = torch.tensor(record["rewards"]), torch.tensor(record["group_ids"])
    return mixed_advantages(torch.tensor(record["rollout_logprobs"]), torch.tensor(record["teacher_logprobs"]),
                            torch.tensor(record["loss_mask"]), torch.tensor(record["sample_index"]),
                            torch.tensor(record["taught"]).bool(), group_advantages(rewards, group_ids=groups))


EXPECTED = {
    # name: (advantage function of the recorded inputs, loss class, π_old given to the loss, π_old equal to π_roll)
    "grpo": (lambda r: group_advantages(torch.tensor(r["rewards"]), group_ids=torch.tensor(r["group_ids"])),
             "PPOLoss", True, False),
    "async_reinforce": (lambda r: group_centered_advantages(torch.tensor(r["rewards"]),
                                                            group_ids=torch.tensor(r["group_ids"])),
                        "DISLoss", False, False),
    "sao": (_critic_gae, "DISLoss", False, False),
    "opd": (_teacher_advantages, "PPOLoss", True, False),
}
OPTIONS = {"sao": {"critic_warmup_steps": 0}}  # the policy trains in the one step


def test_every_registered_algorithm_has_a_loop_test():
    assert set(EXPECTED) == set(ALGORITHMS)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_one_real_step_runs_the_algorithms_advantages_and_loss(name, tmp_path, monkeypatch, ray_cluster):
    from slime_dsa.algorithms import specs
    from slime_dsa.orchestrator.train import run_training
    from tests.plugins.recording import recording

    record = tmp_path / "loss.jsonl"
    monkeypatch.setitem(specs.ALGORITHMS, name, recording(ALGORITHMS[name], str(record)))
    teachers = []
    if ALGORITHMS[name].advantage_source == "teacher":
        from tests.teacher_helpers import make_expert

        teachers = [{"name": "calc", "path": str(make_expert(tmp_path / "expert", seed=7)), "domains": ["arithmetic"]}]
    recipe = {
        "model": {"preset": "tiny"}, "algorithm": {"name": name, **OPTIONS.get(name, {})},
        "data": {"tasks": [{"kind": "arithmetic", "reward_fn": "tests.plugins.rewards:digit_fraction"}],
                 "max_prompt_length": 64},
        "rollout": {"n_samples_per_prompt": 4, "prompts_per_step": 2, "max_response_length": 8},
        "trainer": {"num_steps": 1, "micro_batch_tokens": 256, "learning_rate": 1e-3},
        "logging": {"wandb_mode": "disabled", "run_dir": str(tmp_path / "run")},
        "teachers": teachers,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run_dir = run_training(load_recipe(path))

    advantage_fn, loss_name, has_old, old_is_rollout = EXPECTED[name]
    (adv,) = [json.loads(line) for line in record.with_suffix(".advantages.jsonl").read_text().splitlines()]
    assert len(adv["rewards"]) == 8 and len(set(adv["group_ids"])) == 2
    assert torch.allclose(torch.tensor(adv["advantages"]), advantage_fn(adv).float(), atol=1e-4)
    losses = [json.loads(line) for line in record.read_text().splitlines()]
    assert losses and all(r["loss"] == loss_name for r in losses)
    assert all(r["has_old_logprobs"] == has_old and r["has_rollout_logprobs"] for r in losses)
    assert all(r["old_equals_rollout"] == old_is_rollout for r in losses)
    # the loss saw the advantages the advantage function returned, broadcast to the tokens it trained on
    seen = {round(a, 4) for r in losses for a in r["advantages"]}
    assert seen and seen <= {round(a, 4) for a in adv["advantages"]}
    (metrics,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics["train/num_tokens"] > 0 and sum(r["tokens"] for r in losses) > 0
    if teachers:  # every sample was scored by its teacher, and the step logged what it cost
        assert all(adv["taught"]) and "opd/arithmetic/reverse_kl" in metrics
        assert metrics["teacher/calc/samples"] == 8 and metrics["teacher/calc/tok_s"] > 0
