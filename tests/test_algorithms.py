"""slime_dsa.algorithms against direct, loop-by-loop transcriptions of docs/algorithms.md §1–§5, §7.

Every reference below walks tokens and samples with plain Python loops (scalars, Python min/max) and never
calls the code under test; gradients are compared through torch.autograd.grad on both sides.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

import pytest
import torch

from slime_dsa.algorithms import (
    DISLoss,
    LossInputs,
    PPOLoss,
    ValueLoss,
    ValueLossInputs,
    aggregate,
    broadcast_to_tokens,
    decoupled_gae,
    entropy_mean,
    explained_variance,
    gae,
    group_advantages,
    group_centered_advantages,
    kl_estimate,
    length_adaptive_lambda,
    opd_advantages,
    reverse_kl_per_sample,
    sample_index_from_cu_seqlens,
    zero_std_groups,
)


@pytest.fixture(autouse=True)
def float64_default():
    """References are exact Python arithmetic: keep float32 noise out of the comparison (restored after)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def num(x) -> float:
    """A Python float of a number or 0-d tensor (gradients stripped)."""
    return x.detach().item() if isinstance(x, torch.Tensor) else float(x)


def make_batch(seed: int = 0, n: int = 6, spread: float = 0.4, dtype=torch.float64) -> dict:
    """A packed batch of n samples of uneven length; sample 2 has no generated token at all."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (n,), generator=g)
    sample_index = torch.repeat_interleave(torch.arange(n), lengths)
    t = len(sample_index)
    loss_mask = (torch.rand(t, generator=g) < 0.7).to(dtype)
    loss_mask[sample_index == 2] = 0.0
    loss_mask[0] = 1.0
    logprobs = (-3 * torch.rand(t, generator=g)).to(dtype).requires_grad_()
    old = logprobs.detach() + spread * torch.randn(t, generator=g, dtype=dtype)
    rollout = old + spread * torch.randn(t, generator=g, dtype=dtype)
    ref = logprobs.detach() + spread * torch.randn(t, generator=g, dtype=dtype)
    adv = broadcast_to_tokens(torch.randn(n, generator=g, dtype=dtype), sample_index)
    adv = adv + 0.3 * torch.randn(t, generator=g, dtype=dtype)  # per-token advantages, both signs
    entropy = torch.rand(t, generator=g, dtype=dtype).requires_grad_()
    return dict(logprobs=logprobs, old_logprobs=old, rollout_logprobs=rollout, ref_logprobs=ref, advantages=adv,
                loss_mask=loss_mask, sample_index=sample_index, entropy=entropy)


def inputs_of(b: dict, **overrides) -> LossInputs:
    return LossInputs(**{**b, **overrides})


def reduce_naive(per_token: dict[int, object], b: dict, aggregation: str):
    """Token mean or sequence mean of per-token terms {t: term} over masked tokens, by loops."""
    zero = b["logprobs"].sum() * 0.0
    if aggregation == "token_mean":
        total, count = zero, 0
        for t, term in per_token.items():
            total = total + term
            count += 1
        return total / count
    by_sample = defaultdict(list)
    for t, term in per_token.items():
        by_sample[int(b["sample_index"][t])].append(term)
    total = zero
    for terms in by_sample.values():
        s = zero
        for term in terms:
            s = s + term
        total = total + s / len(terms)
    return total / len(by_sample)


def naive_ppo(b, eps_low=0.2, eps_high=0.28, dual=None, correction="none", alpha=0.5, beta=2.0, cap=2.0,
              aggregation="token_mean", bypass=False):
    lp, adv, mask = b["logprobs"], b["advantages"], b["loss_mask"]
    old = b["rollout_logprobs"] if bypass else b["old_logprobs"]
    terms = {}
    for t in range(len(lp)):
        if mask[t] == 0:
            continue
        r = torch.exp(lp[t] - num(old[t]))
        a = num(adv[t])
        clipped_r = min(max(r, 1 - eps_low), 1 + eps_high)
        term = -min(r * a, clipped_r * a)
        if dual is not None and a < 0:
            term = min(term, -dual * a)
        k = math.exp(num(old[t]) - num(b["rollout_logprobs"][t]))
        if correction == "icepop":
            term = (k if alpha <= k <= beta else 0.0) * term
        elif correction == "tis":
            term = min(k, cap) * term
        terms[t] = term
    return reduce_naive(terms, b, aggregation)


def assert_value_and_grad(loss, reference, wrt):
    assert torch.allclose(loss, reference, rtol=1e-10, atol=1e-12), (num(loss), num(reference))
    (g,) = torch.autograd.grad(loss, wrt, retain_graph=True)
    (g_ref,) = torch.autograd.grad(reference, wrt, retain_graph=True)
    assert torch.allclose(g, g_ref, rtol=1e-10, atol=1e-12)
    return g


# ---------------------------------------------------------------------------------------------- PPO / GRPO


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("cfg", [
    {},
    {"eps_low": 0.1, "eps_high": 0.5},
    {"dual": 3.0},
    {"correction": "icepop"},
    {"correction": "icepop", "alpha": 0.8, "beta": 1.25},
    {"correction": "tis", "cap": 1.5},
    {"bypass": True},
])
def test_ppo_matches_transcription(cfg, aggregation):
    b = make_batch(seed=1, spread=0.6)
    loss_cfg = {"eps_low": cfg.get("eps_low", 0.2), "eps_high": cfg.get("eps_high", 0.28), "dual_clip": cfg.get("dual"),
                "is_correction": cfg.get("correction", "none"), "icepop_alpha": cfg.get("alpha", 0.5),
                "icepop_beta": cfg.get("beta", 2.0), "tis_cap": cfg.get("cap", 2.0), "bypass": cfg.get("bypass", False)}
    out = PPOLoss(aggregation=aggregation, **loss_cfg)(inputs_of(b))
    assert_value_and_grad(out.loss, naive_ppo(b, aggregation=aggregation, **cfg), b["logprobs"])
    assert not out.metrics["loss"].requires_grad


def test_ppo_gradient_is_zero_exactly_where_clipped():
    b = make_batch(seed=2, spread=0.6)
    out = PPOLoss()(inputs_of(b))
    (g,) = torch.autograd.grad(out.loss, b["logprobs"])
    r = torch.exp(b["logprobs"].detach() - b["old_logprobs"])
    a = b["advantages"]
    clipped = ((a > 0) & (r > 1.28)) | ((a < 0) & (r < 0.8))
    masked_out = b["loss_mask"] == 0
    assert clipped.any() and (~clipped & ~masked_out).any()
    assert torch.all(g[clipped | masked_out] == 0)
    n = b["loss_mask"].sum()
    expected = -a * r / n  # d(-rA)/dlogp = -rA, token mean
    keep = ~clipped & ~masked_out
    assert torch.allclose(g[keep], expected[keep])
    # clip fractions count what the loop sees
    m = ~masked_out
    low = ((a < 0) & (r < 0.8) & m).sum() / n
    high = ((a > 0) & (r > 1.28) & m).sum() / n
    assert torch.isclose(out.metrics["pg_clipfrac_low"], low) and torch.isclose(out.metrics["pg_clipfrac_high"], high)
    assert torch.isclose(out.metrics["pg_clipfrac"], low + high)
    kl = sum(num(r[t] - 1 - torch.log(r[t])) for t in range(len(r)) if m[t]) / num(n)
    assert math.isclose(num(out.metrics["approx_kl"]), kl, rel_tol=1e-10)
    assert math.isclose(num(out.metrics["ratio_max"]), max(num(r[t]) for t in range(len(r)) if m[t]))


def test_clip_higher_is_asymmetric():
    lp = torch.log(torch.tensor([1.25, 0.85, 0.75])).requires_grad_()
    b = dict(logprobs=lp, old_logprobs=torch.zeros(3), advantages=torch.tensor([1.0, -1.0, -1.0]),
             loss_mask=torch.ones(3), sample_index=torch.zeros(3, dtype=torch.long))
    out = PPOLoss(eps_low=0.2, eps_high=0.28)(LossInputs(**b))
    (g,) = torch.autograd.grad(out.loss, lp)
    # r=1.25 < 1.28 with A>0 still learns (symmetric 0.2 would clip it); r=0.85 learns; r=0.75 < 0.8 is clipped
    assert g[0] != 0 and g[1] != 0 and g[2] == 0
    assert math.isclose(num(out.loss), -(1.25 - 0.85 - 0.8) / 3)


def test_dual_clip_only_for_negative_advantages():
    lp = torch.log(torch.tensor([5.0, 5.0, 2.0])).requires_grad_()
    b = dict(logprobs=lp, old_logprobs=torch.zeros(3), advantages=torch.tensor([-1.0, 1.0, -1.0]),
             loss_mask=torch.ones(3), sample_index=torch.arange(3))
    plain = PPOLoss()(LossInputs(**b))
    dual = PPOLoss(dual_clip=3.0)(LossInputs(**b))
    # A=-1, r=5: plain loss 5 (unbounded), dual-clipped to 3 with zero gradient; A=+1, r=5: 1.28 either way
    assert math.isclose(num(plain.loss), (5.0 - 1.28 + 2.0) / 3)
    assert math.isclose(num(dual.loss), (3.0 - 1.28 + 2.0) / 3)
    (g,) = torch.autograd.grad(dual.loss, lp)
    assert g[0] == 0 and g[1] == 0 and math.isclose(num(g[2]), 2.0 / 3)
    assert math.isclose(num(dual.metrics["pg_clipfrac_dual"]), 1 / 3)


def test_icepop_masked_tokens_stay_in_the_denominator():
    b = make_batch(seed=3, spread=0.6)
    out = PPOLoss(is_correction="icepop")(inputs_of(b))
    k = torch.exp(b["old_logprobs"] - b["rollout_logprobs"])
    m = b["loss_mask"] > 0
    dropped = ((k < 0.5) | (k > 2.0)) & m
    assert dropped.any() and (m & ~dropped).any()
    r = torch.exp(b["logprobs"].detach() - b["old_logprobs"])
    a = b["advantages"]
    surr = torch.maximum(-a * r, -a * r.clamp(0.8, 1.28))
    kept = m & ~dropped
    assert torch.isclose(out.loss, (k * surr)[kept].sum() / m.sum())  # / all masked tokens
    assert not torch.isclose(out.loss, (k * surr)[kept].sum() / kept.sum())  # not / the tokens it kept
    (g,) = torch.autograd.grad(out.loss, b["logprobs"])
    assert torch.all(g[dropped] == 0)
    assert torch.isclose(out.metrics["icepop_mask_frac"], dropped.sum() / m.sum())
    assert torch.isclose(out.metrics["train_rollout_logprob_abs_diff"],
                         (b["old_logprobs"] - b["rollout_logprobs"]).abs()[m].mean())


def test_tis_metric_and_bypass_equals_old_from_rollout():
    b = make_batch(seed=4, spread=0.6)
    out = PPOLoss(is_correction="tis", tis_cap=1.5)(inputs_of(b))
    k = torch.exp(b["old_logprobs"] - b["rollout_logprobs"])
    m = b["loss_mask"] > 0
    assert torch.isclose(out.metrics["tis_clip_frac"], (k[m] > 1.5).double().mean())
    bypass = PPOLoss(bypass=True)(inputs_of(b, old_logprobs=None))
    explicit = PPOLoss()(inputs_of(b, old_logprobs=b["rollout_logprobs"]))
    assert torch.equal(bypass.loss, explicit.loss)


def test_token_mean_and_seq_mean_differ_as_expected():
    # sample 0: one token with loss 1; sample 1: three tokens with loss 0 (A=0)
    lp = torch.zeros(4, requires_grad=True)
    b = dict(logprobs=lp, old_logprobs=torch.zeros(4), advantages=torch.tensor([-1.0, 0.0, 0.0, 0.0]),
             loss_mask=torch.ones(4), sample_index=torch.tensor([0, 1, 1, 1]))
    assert math.isclose(num(PPOLoss()(LossInputs(**b)).loss), 1 / 4)  # token mean: 1 / 4 tokens
    assert math.isclose(num(PPOLoss(aggregation="seq_mean")(LossInputs(**b)).loss), 1 / 2)  # mean of (1, 0)
    # equal masked lengths: the two agree
    b2 = make_batch(seed=5)
    b2["sample_index"] = torch.arange(len(b2["logprobs"])) % 3
    b2["loss_mask"] = torch.ones(len(b2["logprobs"]))
    b2["loss_mask"][len(b2["logprobs"]) // 3 * 3:] = 0
    assert torch.isclose(PPOLoss()(inputs_of(b2)).loss, PPOLoss(aggregation="seq_mean")(inputs_of(b2)).loss)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_micro_batches_with_step_denominator_add_up(aggregation):
    b = make_batch(seed=6)
    full = PPOLoss(aggregation=aggregation)(inputs_of(b)).loss
    m = b["loss_mask"]
    denominator = m.sum() if aggregation == "token_mean" else num(len({int(s) for s, x in zip(b["sample_index"], m) if x}))
    split = int((b["sample_index"] < 3).sum())
    parts = []
    for sl in (slice(0, split), slice(split, None)):
        part = {k: v[sl] for k, v in b.items()}
        parts.append(PPOLoss(aggregation=aggregation)(LossInputs(**part, denominator=denominator)).loss)
    assert torch.isclose(parts[0] + parts[1], full)


# ---------------------------------------------------------------------------------------------- DIS


def naive_dis_value(b, eps_l, eps_h):
    terms = {}
    for t in range(len(b["logprobs"])):
        if b["loss_mask"][t] == 0:
            continue
        r = torch.exp(b["logprobs"][t] - num(b["rollout_logprobs"][t]))
        inside = 1.0 if 1 - eps_l < num(r) < 1 + eps_h else 0.0
        terms[t] = -inside * r * num(b["advantages"][t])
    return reduce_naive(terms, b, "token_mean")


def naive_dis_surrogate(b, eps_l, eps_h):
    """- token_mean( sg(f(r)) · A · log π_θ ): a different value, the gradient the paper writes."""
    terms = {}
    for t in range(len(b["logprobs"])):
        if b["loss_mask"][t] == 0:
            continue
        r = math.exp(num(b["logprobs"][t]) - num(b["rollout_logprobs"][t]))
        f = r if 1 - eps_l < r < 1 + eps_h else 0.0
        terms[t] = -f * num(b["advantages"][t]) * b["logprobs"][t]
    return reduce_naive(terms, b, "token_mean")


@pytest.mark.parametrize("eps", [(0.3, 5.0), (0.8, 3.0), (0.1, 0.2)])
def test_dis_value_and_gradient(eps):
    b = make_batch(seed=7, spread=0.7)
    out = DISLoss(eps_low=eps[0], eps_high=eps[1])(inputs_of(b, old_logprobs=None))
    g = assert_value_and_grad(out.loss, naive_dis_value(b, *eps), b["logprobs"])
    (g_sur,) = torch.autograd.grad(naive_dis_surrogate(b, *eps), b["logprobs"])
    assert torch.allclose(g, g_sur, rtol=1e-10, atol=1e-12)


def test_dis_out_of_range_tokens_get_zero_gradient_for_both_signs():
    r = torch.tensor([0.5, 0.5, 7.0, 7.0, 1.5, 1.5])
    lp = torch.log(r).requires_grad_()
    b = dict(logprobs=lp, rollout_logprobs=torch.zeros(6), advantages=torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0]),
             loss_mask=torch.ones(6), sample_index=torch.zeros(6, dtype=torch.long))
    out = DISLoss()(LossInputs(**b))  # ε_l 0.3, ε_h 5.0: in range (0.7, 6.0)
    (g,) = torch.autograd.grad(out.loss, lp)
    assert torch.all(g[:4] == 0)
    assert torch.allclose(g[4:], torch.tensor([-1.5, 1.5]) / 6)
    assert math.isclose(num(out.loss), 0.0, abs_tol=1e-12)  # the two in-range terms cancel
    assert math.isclose(num(out.metrics["dis_frac_below"]), 2 / 6)
    assert math.isclose(num(out.metrics["dis_frac_above"]), 2 / 6)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        DISLoss()(LossInputs(**{**b, "rollout_logprobs": None}))


# ---------------------------------------------------------------------------------------------- KL, entropy, OPD


def test_kl_estimators_per_token():
    lp, ref = torch.tensor([-1.0, -2.0, -0.1, -30.0]), torch.tensor([-1.5, -1.0, -0.1, -1.0])
    for t in range(4):
        x = num(lp[t] - ref[t])
        assert math.isclose(num(kl_estimate(lp, ref, "k1")[t]), x)
        assert math.isclose(num(kl_estimate(lp, ref, "k2")[t]), 0.5 * x * x)
        assert math.isclose(num(kl_estimate(lp, ref, "k3")[t]), math.exp(-x) - 1 + x, rel_tol=1e-9)
        xc = max(-20.0, min(20.0, x))
        assert math.isclose(num(kl_estimate(lp, ref, "low_var_kl")[t]), max(-10.0, min(10.0, math.exp(-xc) - 1 + xc)), rel_tol=1e-9)
    assert num(kl_estimate(lp, ref, "low_var_kl")[3]) == 10.0  # clamped
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(lp, ref, "k9")


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_kl_and_entropy_terms_are_added(aggregation):
    b = make_batch(seed=8)
    base = PPOLoss(aggregation=aggregation)(inputs_of(b, ref_logprobs=None, entropy=None)).loss
    out = PPOLoss(aggregation=aggregation, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)(inputs_of(b))
    kl_terms, ent_terms = {}, {}
    for t in range(len(b["logprobs"])):
        if b["loss_mask"][t]:
            x = b["logprobs"][t] - num(b["ref_logprobs"][t])
            kl_terms[t] = torch.exp(-x) - 1 + x
            ent_terms[t] = b["entropy"][t]
    reference = naive_ppo(b, aggregation=aggregation) + 0.1 * reduce_naive(kl_terms, b, aggregation) \
        - 0.01 * reduce_naive(ent_terms, b, aggregation)
    assert_value_and_grad(out.loss, reference, b["logprobs"])
    assert_value_and_grad(out.loss, reference, b["entropy"])
    assert not torch.isclose(out.loss, base)
    assert torch.isclose(out.metrics["entropy"], b["entropy"].detach()[b["loss_mask"] > 0].mean())
    assert torch.isclose(entropy_mean(b["entropy"], b["loss_mask"], b["sample_index"], aggregation),
                         reduce_naive(ent_terms, b, aggregation))
    with pytest.raises(ValueError, match="ref_logprobs is required"):
        PPOLoss(kl_coef=0.1)(inputs_of(b, ref_logprobs=None))


def test_opd_advantage():
    b = make_batch(seed=9)
    teacher = b["ref_logprobs"]
    task = b["advantages"]
    adv = opd_advantages(b["logprobs"], teacher, b["loss_mask"], opd_coef=0.5, task_advantages=task)
    assert not adv.requires_grad
    for t in range(len(adv)):
        expected = (-0.5 * (num(b["logprobs"][t]) - num(teacher[t])) + num(task[t])) if b["loss_mask"][t] else 0.0
        assert math.isclose(num(adv[t]), expected, abs_tol=1e-12)
    per_sample = reverse_kl_per_sample(b["logprobs"], teacher, b["loss_mask"], b["sample_index"])
    for i in range(len(per_sample)):
        diffs = [num(b["logprobs"][t] - teacher[t]) for t in range(len(adv)) if b["sample_index"][t] == i and b["loss_mask"][t]]
        assert math.isclose(num(per_sample[i]), sum(diffs) / len(diffs) if diffs else 0.0, abs_tol=1e-12)
    # the OPD advantage drives the ordinary clipped loss
    out = PPOLoss()(inputs_of(b, advantages=adv))
    assert_value_and_grad(out.loss, naive_ppo({**b, "advantages": adv}), b["logprobs"])


# ---------------------------------------------------------------------------------------------- advantages


def naive_group_advantages(rewards, groups, normalize_std=True):
    out = []
    for i, r in enumerate(rewards):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        mean = sum(members) / len(members)
        std = statistics.stdev(members) if len(members) > 1 else 0.0
        out.append((r - mean) / (std + 1e-6) if normalize_std else r - mean)
    return out


@pytest.mark.parametrize("normalize_std", [True, False])
def test_group_advantages(normalize_std):
    g = torch.Generator().manual_seed(10)
    rewards = torch.randint(0, 3, (24,), generator=g).double() + 0.1 * torch.rand(24, generator=g)
    group_ids = torch.tensor([7, 3, 7, 11, 3, 3, 11, 7] * 3)  # arbitrary ids, interleaved
    got = group_advantages(rewards, group_ids=group_ids, normalize_std=normalize_std)
    want = naive_group_advantages(rewards.tolist(), group_ids.tolist(), normalize_std)
    assert torch.allclose(got, torch.tensor(want, dtype=got.dtype), atol=1e-5)
    by_size = group_advantages(rewards, group_size=4, normalize_std=normalize_std)
    want = naive_group_advantages(rewards.tolist(), [i // 4 for i in range(24)], normalize_std)
    assert torch.allclose(by_size, torch.tensor(want, dtype=by_size.dtype), atol=1e-5)
    if normalize_std:
        assert torch.allclose(by_size.view(6, 4).std(dim=1), torch.ones(6, dtype=by_size.dtype), atol=1e-4)
    else:
        assert torch.equal(by_size, group_centered_advantages(rewards, group_size=4))


def test_group_advantage_edge_cases():
    assert torch.equal(group_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), group_size=2), torch.zeros(4))
    assert torch.equal(group_advantages(torch.tensor([3.0]), group_size=1), torch.zeros(1))  # a group of one
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(5), group_size=2)
    with pytest.raises(ValueError, match="exactly one"):
        group_advantages(torch.zeros(4))
    tokens = broadcast_to_tokens(torch.tensor([1.0, 2.0]), torch.tensor([0, 0, 1, 1, 1]))
    assert tokens.tolist() == [1.0, 1.0, 2.0, 2.0, 2.0]


def test_zero_std_groups():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.5])
    assert zero_std_groups(rewards, group_size=3).tolist() == [True, False, False]
    ids = torch.tensor([5, 9, 5, 9, 2, 2, 2, 5, 9])  # groups 2: (1,0,0)  5: (1,1,0)... sorted by id
    want = []
    for gid in sorted(set(ids.tolist())):
        members = [num(rewards[j]) for j in range(9) if ids[j] == gid]
        want.append(max(members) == min(members))
    assert zero_std_groups(rewards, group_ids=ids).tolist() == want
    assert zero_std_groups(torch.tensor([1.0, 1.0 + 1e-9]), group_size=2, atol=1e-6).tolist() == [True]


# ---------------------------------------------------------------------------------------------- GAE


def naive_gae(rewards, values, mask, sample_index, gamma, lam, skip):
    """Backwards over each sample's tokens; with skip, observation tokens are stepped over (turn-boundary rule)."""
    adv, ret = [0.0] * len(rewards), [0.0] * len(rewards)
    for i in sorted(set(sample_index)):
        lam_i = lam[i] if isinstance(lam, list) else lam
        tokens = [t for t in range(len(rewards)) if sample_index[t] == i]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(tokens):
            if skip and mask[t] == 0:
                continue  # no value target, no advantage; V(next action token) carries over the tool output
            delta = rewards[t] + gamma * next_value - values[t]
            adv[t] = delta + gamma * lam_i * next_adv
            ret[t] = adv[t] + values[t]
            next_value, next_adv = values[t], adv[t]
    return adv, ret


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, "adaptive")])
def test_gae_matches_recursion(skip, gamma, lam):
    b = make_batch(seed=11)
    t = len(b["logprobs"])
    g = torch.Generator().manual_seed(12)
    mask, index = b["loss_mask"], b["sample_index"]
    rewards = torch.where(mask > 0, torch.randn(t, generator=g), torch.zeros(t)) if skip else torch.randn(t, generator=g)
    values = torch.randn(t, generator=g)
    lam_arg = length_adaptive_lambda(mask, index, alpha=1.5) if lam == "adaptive" else lam
    out = gae(rewards, values, mask, index, gamma, lam_arg, skip_observations=skip)
    lam_list = lam_arg.tolist() if lam == "adaptive" else lam
    adv, ret = naive_gae(rewards.tolist(), values.tolist(), mask.tolist(), index.tolist(), gamma, lam_list, skip)
    assert torch.allclose(out.advantages.double(), torch.tensor(adv), atol=1e-9)
    assert torch.allclose(out.returns.double(), torch.tensor(ret), atol=1e-9)
    # interleaving the samples in the pack (time order kept within each sample) changes nothing
    slots = torch.empty(t, dtype=torch.long)  # new position of every token
    random_slots = torch.randperm(t, generator=g)
    for i in range(num_samples := int(index.max()) + 1):
        own = torch.nonzero(index == i).flatten()
        slots[own] = torch.sort(random_slots[own]).values
    assert num_samples == 6
    inv = torch.empty(t, dtype=torch.long)
    inv[slots] = torch.arange(t)
    assert not torch.equal(index[inv], index)  # really interleaved
    out2 = gae(rewards[inv], values[inv], mask[inv], index[inv], gamma, lam_arg, skip_observations=skip)
    assert torch.allclose(out2.advantages[slots], out.advantages, atol=1e-6)


def test_skip_observation_turn_boundary_by_hand():
    # one trajectory: [a0 a1 | tool tool | a2], reward 1 on the last action token, γ = 1, λ = 0.5
    mask = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0])
    values = torch.tensor([0.2, 0.4, 9.0, 9.0, 0.6])
    rewards = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0])
    out = gae(rewards, values, mask, torch.zeros(5, dtype=torch.long), gamma=1.0, lam=0.5)
    a2 = 1.0 - 0.6
    a1 = (0.0 + 0.6 - 0.4) + 0.5 * a2  # the boundary: V(a_{i+1,0}) = V(a2), the tool tokens' 9.0 never enter
    a0 = (0.0 + 0.4 - 0.2) + 0.5 * a1
    assert torch.allclose(out.advantages, torch.tensor([a0, a1, 0.0, 0.0, a2]))
    assert torch.allclose(out.returns, torch.tensor([a0 + 0.2, a1 + 0.4, 0.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match="rewards"):
        gae(torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0]), values, mask, torch.zeros(5, dtype=torch.long))


def test_length_adaptive_lambda_and_decoupled_gae():
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    index = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1])
    lam = length_adaptive_lambda(mask, index, alpha=1.5)
    assert torch.allclose(lam, torch.tensor([1 - 1 / (1.5 * 3), 1 - 1 / (1.5 * 4)], dtype=lam.dtype))
    rewards = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 0.5, 0.0, 0.0, -1.0])
    values = torch.linspace(0.1, 0.9, 9)
    out = decoupled_gae(rewards, values, mask, index)
    # λ_critic = 1, γ = 1: returns are the Monte-Carlo sum of later rewards on action tokens
    assert torch.allclose(out.returns, torch.tensor([1.0, 1.0, 0.0, 1.0, -0.5, -0.5, -1.0, 0.0, -1.0]), atol=1e-6)
    adv, _ = naive_gae(rewards.tolist(), values.tolist(), mask.tolist(), index.tolist(), 1.0, lam.tolist(), True)
    assert torch.allclose(out.advantages.double(), torch.tensor(adv), atol=1e-6)


# ---------------------------------------------------------------------------------------------- value loss


def test_value_loss_and_explained_variance():
    b = make_batch(seed=13)
    t = len(b["logprobs"])
    g = torch.Generator().manual_seed(14)
    old = torch.randn(t, generator=g)
    values = (old + 0.4 * torch.randn(t, generator=g)).requires_grad_()
    returns = torch.randn(t, generator=g)
    mask = b["loss_mask"]
    out = ValueLoss(value_clip=0.2)(ValueLossInputs(values, old, returns, mask, b["sample_index"]))
    terms = {}
    for i in range(t):
        if mask[i]:
            v, o, r = values[i], num(old[i]), num(returns[i])
            v_clip = o + min(max(v - o, -0.2), 0.2)
            terms[i] = 0.5 * max((v - r) ** 2, (v_clip - r) ** 2)
    assert_value_and_grad(out.loss, reduce_naive(terms, {**b, "logprobs": values}, "token_mean"), values)
    sel = [i for i in range(t) if mask[i]]
    rs = [num(returns[i]) for i in sel]
    errs = [num(returns[i] - values[i]) for i in sel]
    ev = 1 - statistics.pvariance(errs) / statistics.pvariance(rs)
    assert math.isclose(num(out.metrics["explained_variance"]), ev, rel_tol=1e-9)
    assert math.isclose(num(explained_variance(returns, returns, mask)), 1.0)


# ---------------------------------------------------------------------------------------------- plumbing


def test_loss_option_errors():
    with pytest.raises(ValueError, match="bypass"):
        PPOLoss(is_correction="icepop", bypass=True)
    with pytest.raises(ValueError, match="dual_clip"):
        PPOLoss(dual_clip=0.5)
    with pytest.raises(ValueError, match="aggregation"):
        PPOLoss(aggregation="sum")
    b = make_batch(seed=15)
    with pytest.raises(ValueError, match="old_logprobs is required"):
        PPOLoss()(inputs_of(b, old_logprobs=None))
    with pytest.raises(ValueError, match="advantages must have shape"):
        inputs_of(b, advantages=b["advantages"][:-1])
    with pytest.raises(ValueError, match="loss_mask must be a float"):
        inputs_of(b, loss_mask=b["loss_mask"].bool())


def test_float32_inputs_and_cu_seqlens():
    b = make_batch(seed=16, dtype=torch.float32)
    b = {k: (v.detach().float().requires_grad_(v.requires_grad) if v.is_floating_point() else v) for k, v in b.items()}
    out = PPOLoss(is_correction="icepop")(inputs_of(b))
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    out.loss.backward()
    assert torch.isfinite(b["logprobs"].grad).all()
    index = sample_index_from_cu_seqlens(torch.tensor([0, 2, 2, 5]))
    assert index.tolist() == [0, 0, 2, 2, 2]
    assert torch.isclose(aggregate(torch.arange(5.0), torch.ones(5), index, "seq_mean"), torch.tensor((0.5 + 3.0) / 2))
