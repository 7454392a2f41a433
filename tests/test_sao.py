"""SAO's spec (docs/algorithms.md section 5): what it declares, and its per-token advantages and value targets on packed
multi-turn trajectories (tool spans, a trajectory cut after a tool output, bootstrapping) against a direct
transcription of the formulas written here, walking each trajectory's own token lists."""

from __future__ import annotations

import math
import re

import pytest
import torch
import yaml

from slime_dsa.algorithms import DISLoss, ValueLoss
from slime_dsa.algorithms.specs import build_algorithm
from slime_dsa.config import validate_recipe
from slime_dsa.data.sample import Sample, SampleStatus
from slime_dsa.orchestrator.batching import build_train_batch, critic_advantage_inputs


def _spec(**algorithm):
    return build_algorithm(validate_recipe({"algorithm": {"name": "sao", **algorithm},
                                            "rollout": {"n_samples_per_prompt": 1}}).algorithm)


def _trajectory(index: int, prompt: int, spans: list[tuple[str, int]], reward: float,
                truncated_by: str | None = None) -> Sample:
    """A Sample as the agent loop hands it over: model spans (loss_mask 1, log-probs, versions) and tool spans."""
    sample = Sample(prompt_ids=list(range(3, 3 + prompt)), index=index, group_id=index, reward=reward)
    for kind, n in spans:
        ids = [10 + index] * n
        if kind == "model":
            sample.append_tokens(ids, [-0.5] * n, [0] * n)
        else:
            sample.append_tokens(ids, trainable=False)
    sample.status = SampleStatus.TRUNCATED if truncated_by else SampleStatus.COMPLETED
    if truncated_by:
        sample.metadata["truncated_by"] = truncated_by
    return sample.validate()


SAMPLES = [
    _trajectory(0, 4, [("model", 5), ("tool", 3), ("model", 4), ("tool", 2), ("model", 3)], reward=1.0),
    _trajectory(1, 2, [("model", 6)], reward=0.0),  # single turn, ended
    _trajectory(2, 3, [("model", 2), ("tool", 4), ("model", 2), ("tool", 3)], reward=0.5,
                truncated_by="max_turns"),  # cut after a tool output: bootstraps from V after it
    _trajectory(3, 5, [("model", 7)], reward=0.25, truncated_by="max_tokens"),  # the agent's token limit
    _trajectory(4, 1, [("model", 1), ("tool", 2), ("model", 1)], reward=-1.0),  # l = 2 action tokens
    _trajectory(5, 2, [("model", 3)], reward=0.0),  # below: a single response cut at max_response_length
]
SAMPLES[5].status = SampleStatus.TRUNCATED  # no truncated_by: its reward function scored it, the episode ended


def transcription(sample: Sample, values: list[float], bootstrap: float, gamma: float, lam: float,
                  ) -> tuple[list[float], list[float]]:
    """Advantages and returns of one trajectory's response tokens, by the recursion of section 5: backwards over the
    action tokens only; the reward on the last one; after it V = bootstrap (0 when the episode ended)."""
    actions = [t for t, m in enumerate(sample.loss_mask) if m == 1]
    adv = [0.0] * len(sample.loss_mask)
    ret = [0.0] * len(sample.loss_mask)
    next_value, next_adv = bootstrap, 0.0
    for t in reversed(actions):
        reward = sample.reward if t == actions[-1] else 0.0
        delta = reward + gamma * next_value - values[t]
        adv[t] = delta + gamma * lam * next_adv
        ret[t] = adv[t] + values[t]
        next_value, next_adv = values[t], adv[t]
    return adv, ret


def _packed(samples, seed=0):
    batch = build_train_batch(samples, torch.zeros(len(samples)))
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(batch.num_tokens, generator=g)
    final = torch.randn(len(samples), generator=g)
    return batch, critic_advantage_inputs(samples, batch, values, final)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("bootstrap_truncated", [True, False])
def test_gae_over_packed_trajectories_matches_the_transcription(gamma, bootstrap_truncated):
    spec = _spec(gae_gamma=gamma, bootstrap_truncated=bootstrap_truncated)
    batch, inputs = _packed(SAMPLES)
    advantages, returns = spec.advantages(inputs), spec.value_targets(inputs)
    assert advantages.shape == returns.shape == (batch.num_tokens,) and advantages.dtype == torch.float32
    start = 0
    for i, sample in enumerate(SAMPLES):
        p, n = len(sample.prompt_ids), sample.response_length
        values = inputs.values[start + p : start + p + n].tolist()  # V(s_t) of each response token
        cut = "truncated_by" in sample.metadata and bootstrap_truncated
        bootstrap = float(inputs.final_values[i]) if cut else 0.0
        actions = sum(sample.loss_mask)
        lam_actor = min(max(1 - 1 / (1.5 * actions), 0.0), 1.0)
        want_adv, _ = transcription(sample, values, bootstrap, gamma, lam_actor)
        _, want_ret = transcription(sample, values, bootstrap, gamma, 1.0)
        got_adv = advantages[start + p : start + p + n].tolist()
        got_ret = returns[start + p : start + p + n].tolist()
        assert got_adv == pytest.approx(want_adv, abs=1e-5), f"sample {i}"
        assert got_ret == pytest.approx(want_ret, abs=1e-5), f"sample {i}"
        assert advantages[start : start + p].abs().sum() == 0  # prompt rows carry nothing
        start += p + n
    assert start == batch.num_tokens
    tools = batch.loss_mask == 0
    assert advantages[tools].abs().sum() == 0 and returns[tools].abs().sum() == 0  # no target, no gradient


def test_lambda_one_returns_are_monte_carlo():
    """λ_critic = 1, γ = 1: every action token's target is the trajectory's reward (plus the bootstrap when cut)."""
    batch, inputs = _packed(SAMPLES, seed=3)
    returns = _spec().value_targets(inputs)
    start = 0
    for i, sample in enumerate(SAMPLES):
        p, n = len(sample.prompt_ids), sample.response_length
        cut = float(inputs.final_values[i]) if "truncated_by" in sample.metadata else 0.0
        for t, m in enumerate(sample.loss_mask):
            if m:
                assert math.isclose(float(returns[start + p + t]), sample.reward + cut, abs_tol=1e-5)
        start += p + n


def test_sao_declares_its_loop_roles_losses_and_critic_schedule():
    spec = _spec(dis_eps_low=0.8, dis_eps_high=3.0, value_clip=0.2, critic_updates_per_step=3,
                 critic_warmup_steps=4)
    assert (spec.loop, spec.old_logprobs, spec.advantage_source, spec.advantage_level) == ("async", "none", "critic",
                                                                                             "token")
    assert spec.roles == ("policy", "critic") and spec.min_group_size == 1
    loss = spec.policy_loss()
    assert isinstance(loss, DISLoss) and (loss.eps_low, loss.eps_high) == (0.8, 3.0)
    assert spec.value_loss() == ValueLoss(value_clip=0.2)
    assert _spec().value_loss().value_clip is None  # unclipped masked MSE unless asked
    assert spec.critic_updates_per_step == 3
    assert [spec.trains_policy(step) for step in range(6)] == [False] * 4 + [True] * 2


def test_sao_metrics_report_lambda_statistics():
    _, inputs = _packed(SAMPLES)
    metrics = _spec().advantage_metrics(inputs)
    lengths = [sum(s.loss_mask) for s in SAMPLES]  # 12, 6, 4, 7, 2, 3 action tokens
    lambdas = [1 - 1 / (1.5 * n) for n in lengths]
    assert metrics["lambda_min"] == pytest.approx(min(lambdas)) and metrics["lambda_max"] == pytest.approx(max(lambdas))
    assert metrics["lambda_mean"] == pytest.approx(sum(lambdas) / len(lambdas))
    assert metrics["bootstrapped_frac"] == pytest.approx(2 / 6)


def test_sao_recipe_keys():
    from slime_dsa.config.errors import RecipeError

    recipe = validate_recipe({"algorithm": {"name": "sao"}, "rollout": {"n_samples_per_prompt": 1},
                              "critic": {"learning_rate": 1e-5, "placement": "separate", "num_workers": 2}})
    assert recipe.critic.num_workers == 2
    with pytest.raises(RecipeError, match=r"critic\.learning_rate is read only by algorithms with a value model \(sao\)"):
        validate_recipe({"critic": {"learning_rate": 1e-5}})
    with pytest.raises(RecipeError, match=r"critic\.num_gpus_per_worker \(1\.0\) applies to placement 'separate'"):
        validate_recipe({"algorithm": {"name": "sao"}, "critic": {"num_gpus_per_worker": 1.0}})
    with pytest.raises(RecipeError, match=r"critic_updates_per_step is not read by algorithm 'async_reinforce' "
                                          r"\(it applies to sao\)"):
        validate_recipe({"algorithm": {"name": "async_reinforce", "critic_updates_per_step": 3}})


def test_recipe_explain_sao_gives_every_key_its_default_and_source():
    from slime_dsa.algorithms.specs import COMMON_OPTIONS, SAO
    from slime_dsa.config import explain
    from slime_dsa.config.schema import AlgorithmSection, CriticSection

    blocks: dict[str, str] = {}  # key -> its line and description
    heads: dict[str, str] = {}  # key -> its line
    key = None
    for line in explain("sao").splitlines():
        if re.match(r"^  [a-z_]+\.[a-z_]+: ", line):
            key = line.split(":", 1)[0].strip()
            blocks[key] = heads[key] = line
        elif key is not None and line.startswith("      "):
            blocks[key] += " " + line.strip()
    own = sorted(SAO.options - COMMON_OPTIONS)
    assert own and all(f"algorithm.{k}" in blocks for k in own)
    assert all(f"critic.{k}" in blocks for k in CriticSection.model_fields)
    for key, block in blocks.items():
        if key.startswith(("algorithm.", "critic.")) and key != "algorithm.name":
            section = AlgorithmSection if key.startswith("algorithm.") else CriticSection
            default = section.model_fields[key.split(".")[1]].default
            shown = heads[key].split(" = ", 1)[1].split("  ")[0]
            assert yaml.safe_load(shown) == default, key  # the default, on the key's line
            assert "Default " in " ".join(block.split()), key  # and where it comes from, in its description


@pytest.mark.parametrize("rewards", [[1.0, 0.0, 0.5], [0.0, 0.0, 0.0]])
def test_explained_variance_is_left_out_of_a_step_whose_targets_all_agree(rewards):
    """A step whose trajectories all scored 0 (frequent with few prompts a step) logged critic/explained_variance
    -2.96e6 (1 - Var(R - V) / 1e-8), which flattened every other step on `report`'s curve."""
    import asyncio  # noqa: PLC0415

    from slime_dsa.orchestrator.critic import critic_estimates  # noqa: PLC0415

    samples = [_trajectory(i, 3, [("model", 4)], reward=r) for i, r in enumerate(rewards)]
    batch = build_train_batch(samples, torch.zeros(len(samples)))

    class Critic:  # FAKE trainer group: the critic's values of every token, and of the state after each sample
        def compute_values(self, batch):
            g = torch.Generator().manual_seed(0)
            return torch.rand(batch.input_ids.shape, generator=g), torch.zeros(len(batch.seqlens))

    metrics = asyncio.run(critic_estimates(Critic(), _spec(gae_gamma=1.0), batch, samples))
    if len(set(rewards)) > 1:
        assert -10 < metrics["critic/explained_variance"] < 1
    else:
        assert "critic/explained_variance" not in metrics
    assert all(math.isfinite(v) for v in metrics.values())
