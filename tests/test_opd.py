"""On-policy distillation's pure parts: the sparse top-k KL and its tail against a direct computation, the mixed
per-token advantages against a transcription of docs/algorithms.md section 7, the student's log-probs at candidate ids
against a direct forward, the OPD spec and its loss, and the recipe checks of the teachers list."""

from __future__ import annotations

import math

import pytest
import torch

from slime_dsa.algorithms import TopKDistillPPOLoss, LossInputs, mixed_advantages, sparse_topk_kl
from slime_dsa.algorithms.specs import AdvantageInputs, build_algorithm
from slime_dsa.config import validate_recipe
from slime_dsa.config.errors import RecipeError


def _direct_bucket_kl(p: list[float], q: list[float], ids: list[int], direction: str) -> float:
    """KL between two full distributions coarsened to the buckets {ids[0]}, ..., {ids[k-1]}, rest; plain Python."""
    rest = [i for i in range(len(p)) if i not in ids]
    bp = [p[i] for i in ids] + [sum(p[i] for i in rest)]
    bq = [q[i] for i in ids] + [sum(q[i] for i in rest)]
    a, b = (bp, bq) if direction == "reverse" else (bq, bp)
    return sum(x * (math.log(x) - math.log(y)) for x, y in zip(a, b) if x > 0)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_sparse_topk_kl_and_its_tail_equal_a_direct_computation(direction):
    g = torch.Generator().manual_seed(0)
    vocab, k = 40, 6
    student = torch.log_softmax(torch.randn(5, vocab, generator=g, dtype=torch.float64) * 2, -1)
    teacher = torch.log_softmax(torch.randn(5, vocab, generator=g, dtype=torch.float64) * 2, -1)
    ids = teacher.topk(k, dim=-1).indices  # the teacher's top-k, as a teacher returns it
    got = sparse_topk_kl(student.gather(1, ids), teacher.gather(1, ids), direction)
    for row in range(5):
        want = _direct_bucket_kl(student[row].exp().tolist(), teacher[row].exp().tolist(), ids[row].tolist(), direction)
        assert got[row].item() == pytest.approx(want, abs=1e-10)
    # k = the whole vocabulary: the tails are empty (floored) and the sparse KL is the full one
    every = torch.arange(vocab).expand(5, vocab)
    full = (student.exp() * (student - teacher)).sum(-1) if direction == "reverse" else \
        (teacher.exp() * (teacher - student)).sum(-1)
    assert torch.allclose(sparse_topk_kl(student.gather(1, every), teacher.gather(1, every), direction), full,
                          atol=1e-6)
    # at most the full KL (data processing), zero against itself
    assert bool((got <= full + 1e-12).all())
    assert torch.allclose(sparse_topk_kl(teacher.gather(1, ids), teacher.gather(1, ids)), torch.zeros(5, dtype=torch.float64))


def test_sparse_topk_kl_gradient_equals_the_direct_one():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 12, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(3, 12, generator=g, dtype=torch.float64), -1)
    ids = teacher.topk(4, dim=-1).indices
    student = torch.log_softmax(logits, -1)
    ours = torch.autograd.grad(sparse_topk_kl(student.gather(1, ids), teacher.gather(1, ids)).sum(), logits)[0]
    # direct: the bucket distributions built with a one-hot map, KL by its definition
    onehot = torch.zeros(3, 12, 5, dtype=torch.float64)
    for r in range(3):
        for j, i in enumerate(ids[r].tolist()):
            onehot[r, i, j] = 1.0
        onehot[r, :, 4] = 1.0 - onehot[r, :, :4].sum(-1)
    bp = torch.einsum("rv,rvb->rb", torch.softmax(logits, -1), onehot)
    bq = torch.einsum("rv,rvb->rb", teacher.exp(), onehot)
    direct = torch.autograd.grad((bp * (bp.log() - bq.log())).sum(), logits)[0]
    assert torch.allclose(ours, direct, atol=1e-10)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_sparse_topk_kl_gradient_is_finite_when_the_student_tail_rounds_to_zero(direction):
    # A collapsed float32 student (p ≈ 1 − 1.2e-7 on one id), log-probs as the trainer computes them: the
    # candidates' log Σ p is −7e-15, exp of it rounds to 1 and the unused branch of log(1 − Σ p) had an infinite
    # derivative: a finite KL with a NaN gradient (the skipped updates of the OPD merge run).
    teacher = torch.log_softmax(torch.tensor([2.0, 1.0, 0.5, 0.0, 0.0, 0.0]), -1)[:3].expand(4, 3)
    logits = torch.tensor([[0.3, a, a - 0.3, -30.0, -30.0, -30.0] for a in (-16.3, -16.25, -16.2, -5.0)],
                          requires_grad=True)
    student = (logits - torch.logsumexp(logits, -1, keepdim=True))[:, :3]  # as slime_dsa.models.logprobs does
    assert torch.logsumexp(student[0], -1).item() < 0.0 and torch.logsumexp(student[0], -1).exp().item() == 1.0
    kl = sparse_topk_kl(student, teacher, direction)
    grad = torch.autograd.grad(kl.sum(), logits)[0]
    assert bool(torch.isfinite(kl).all()) and bool(torch.isfinite(grad).all())
    # the rows whose tail is above the floor keep the exact gradient (float64 reference)
    ref_logits = logits.detach().double().requires_grad_(True)
    ref = (ref_logits - torch.logsumexp(ref_logits, -1, keepdim=True))[:, :3]
    want = torch.autograd.grad(sparse_topk_kl(ref, teacher.double(), direction).sum(), ref_logits)[0]
    assert torch.allclose(grad[3], want[3].float(), rtol=1e-4, atol=1e-6)


def test_mixed_advantages_follow_the_formula():
    # two samples: 0 taught (tokens 1-3 generated), 1 a reward domain (tokens 5-6 generated)
    index = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    mask = torch.tensor([0.0, 1, 1, 1, 0, 1, 1])
    student = torch.tensor([0.0, -1.0, -0.5, -2.0, 0.0, -0.3, -0.1])
    teacher = torch.tensor([0.0, -0.2, -1.5, -2.0, 0.0, 0.0, 0.0])
    taught = torch.tensor([True, False])
    task = torch.tensor([0.7, -0.4])
    got = mixed_advantages(student, teacher, mask, index, taught, task, opd_coef=2.0)
    want = [0.0, -2 * (-1.0 + 0.2), -2 * (-0.5 + 1.5), 0.0, 0.0, -0.4, -0.4]
    assert torch.allclose(got, torch.tensor(want))
    with_task = mixed_advantages(student, teacher, mask, index, taught, task, opd_coef=2.0, add_task_advantage=True)
    assert torch.allclose(with_task, torch.tensor(want) + torch.tensor([0, 0.7, 0.7, 0.7, 0, 0, 0]))
    topk = mixed_advantages(student, teacher, mask, index, taught, task, sampled_estimate=False)
    assert torch.allclose(topk, torch.tensor([0.0, 0, 0, 0, 0, -0.4, -0.4]))


def _recipe(**algorithm):
    return validate_recipe({
        "algorithm": {"name": "opd", **algorithm},
        "data": {"tasks": [{"kind": "arithmetic"}, {"kind": "countdown"}]},
        "teachers": [{"name": "calc", "path": "experts/calc", "domains": ["arithmetic"]}],
    })


def test_opd_spec_mixes_teacher_and_group_advantages():
    recipe = _recipe(opd_coef=0.5, advantage_std_normalize=False)
    spec = build_algorithm(recipe.algorithm)
    assert (spec.loop, spec.advantage_source, spec.advantage_level, spec.teacher_topk) == ("sync", "teacher", "token", 0)
    rewards, groups = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])
    index = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    mask = torch.tensor([0.0, 1, 0, 1, 0, 1, 0, 1])
    student, teacher = -torch.rand(8), -torch.rand(8)
    taught = torch.tensor([True, True, False, False])
    inputs = AdvantageInputs(rewards, groups, loss_mask=mask, sample_index=index, rollout_logprobs=student,
                             teacher_logprobs=teacher, taught=taught)
    want = mixed_advantages(student, teacher, mask, index, taught, torch.tensor([0.5, -0.5, 0.0, 0.0]), opd_coef=0.5)
    assert torch.allclose(spec.advantages(inputs), want)
    with pytest.raises(ValueError, match="rollout_logprobs is required"):
        spec.advantages(AdvantageInputs(rewards, groups, loss_mask=mask, sample_index=index))
    assert type(spec.policy_loss()).__name__ == "PPOLoss"
    loss = build_algorithm(_recipe(opd_topk=16, opd_coef=0.3).algorithm).policy_loss()
    assert isinstance(loss, TopKDistillPPOLoss) and loss.distill_coef == 0.3


def test_topk_distill_loss_adds_the_sparse_kl_on_candidate_rows():
    g = torch.Generator().manual_seed(2)
    T, K = 6, 3
    logits = torch.randn(T, 10, generator=g, requires_grad=True)
    logp_all = torch.log_softmax(logits, -1)
    target = torch.log_softmax(torch.randn(T, 10, generator=g), -1)
    ids = target.topk(K, -1).indices
    tokens = torch.randint(0, 10, (T,), generator=g)
    logp = logp_all.gather(1, tokens[:, None]).squeeze(1)
    rows = torch.tensor([0.0, 1, 1, 0, 1, 1])
    inputs = LossInputs(logprobs=logp, advantages=torch.zeros(T), loss_mask=torch.tensor([0.0, 1, 1, 1, 1, 1]),
                        sample_index=torch.tensor([0, 0, 0, 1, 1, 1]), old_logprobs=logp.detach(),
                        candidate_logprobs=logp_all.gather(1, ids), candidate_target_logprobs=target.gather(1, ids),
                        candidate_mask=rows)
    out = TopKDistillPPOLoss(distill_coef=2.0)(inputs)
    kl = sparse_topk_kl(logp_all.gather(1, ids), target.gather(1, ids))
    assert float(out.loss.detach()) == pytest.approx(float(2.0 * (kl.detach() * rows).sum() / 5), rel=1e-5)  # A = 0: only the KL
    assert float(out.metrics["topk_kl"]) == pytest.approx(float((kl.detach() * rows).sum() / 4), rel=1e-5)
    with pytest.raises(ValueError, match="candidate_mask"):
        LossInputs(logprobs=logp, advantages=torch.zeros(T), loss_mask=rows, sample_index=torch.zeros(T, dtype=torch.long),
                   candidate_logprobs=logp_all.gather(1, ids), candidate_target_logprobs=target.gather(1, ids))


def test_candidate_logprobs_equal_a_direct_forward():
    from slime_dsa.checkpoint import build_model
    from slime_dsa.models import PackedBatch
    from slime_dsa.models.prefix_sharing import pack_shared_prefixes
    from slime_dsa.models.presets import preset_config

    model = build_model(preset_config("tiny", vocab_size=50, eos_token_id=1), seed=0).eval()
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 50, (4,), generator=g).tolist()
    seqs = [prompt + torch.randint(0, 50, (n,), generator=g).tolist() for n in (3, 5)]
    ids, seqlens = torch.tensor(seqs[0] + seqs[1]), [7, 9]
    cand = torch.randint(0, 50, (16, 5), generator=g)
    with torch.no_grad():
        flat_logp, _, out = model.token_logprobs_with_output(ids, PackedBatch.from_seqlens(seqlens), temperature=0.7,
                                                             chunk_size=3, candidate_ids=cand)
        pack = pack_shared_prefixes(ids, seqlens, [4, 4])
        _, _, shared = model.token_logprobs_with_output(ids, PackedBatch.from_seqlens(seqlens), temperature=0.7,
                                                        candidate_ids=cand, prefix_pack=pack)
        start = 0
        for seq in seqs:
            full = torch.log_softmax(model(torch.tensor(seq)[None]).logits[0].float() / 0.7, -1)  # (L, V)
            rows = torch.arange(start + 1, start + len(seq))  # token rows 1.. get the distribution of row - 1
            want = full[:-1].gather(1, cand[rows])
            assert torch.allclose(out.candidate_logprobs[rows], want, atol=1e-5)
            assert torch.equal(out.candidate_logprobs[start], torch.zeros(5))
            response = rows[3:]  # after the 4-token prompt
            assert torch.allclose(shared.candidate_logprobs[response], want[3:], atol=1e-5)
            start += len(seq)


def test_recipe_checks_of_the_teachers_list():
    def refused(match: str, **changes):
        base = {"algorithm": {"name": "opd"}, "data": {"tasks": [{"kind": "arithmetic"}, {"kind": "countdown"}]},
                "teachers": [{"name": "calc", "path": "experts/calc", "domains": ["arithmetic"]}]}
        base.update(changes)
        with pytest.raises(RecipeError, match=match) as info:
            validate_recipe(base)
        assert "\n" not in str(info.value)

    refused("needs at least one entry in teachers", teachers=[])
    refused("teachers are read only by algorithms with a teacher", algorithm={"name": "grpo"})
    refused("'sort', which is not a task", teachers=[{"name": "t", "path": "p", "domains": ["sort"]}])
    refused("teachers.0.name: string should match pattern", teachers=[{"name": "math/v2", "path": "p",
                                                                      "domains": ["arithmetic"]}])
    refused("two teachers", teachers=[{"name": "a", "path": "p", "domains": ["arithmetic"]},
                                      {"name": "b", "path": "q", "domains": ["arithmetic"]}])
    refused("must be unique", teachers=[{"name": "a", "path": "p", "domains": ["arithmetic"]},
                                        {"name": "a", "path": "q", "domains": ["countdown"]}])
    refused("needs urls", teachers=[{"name": "a", "path": "p", "domains": ["arithmetic"], "serving": "external"}])
    refused("swap_group is read by serving 'swap'",
            teachers=[{"name": "a", "path": "p", "domains": ["arithmetic"], "swap_group": "g"}])
    refused("needs GPUs", teachers=[{"name": "a", "path": "p", "domains": ["arithmetic"], "serving": "sglang"}])
    refused("reward domain 'countdown'", rollout={"n_samples_per_prompt": 1})
    refused("top_p", rollout={"top_p": 0.9})
    refused("dynamic_sampling", rollout={"dynamic_sampling": True})
    refused("opd_topk is not read by algorithm 'grpo'", algorithm={"name": "grpo", "opd_topk": 4}, teachers=[])
    refused("trainer.backend megatron does not compute yet", algorithm={"name": "opd", "opd_topk": 4},
            trainer={"backend": "megatron"})
    # one domain per task, every task taught: groups of one are fine
    ok = validate_recipe({"algorithm": {"name": "opd"}, "rollout": {"n_samples_per_prompt": 1},
                          "teachers": [{"name": "a", "path": "p", "domains": ["arithmetic"], "serving": "swap"}]})
    assert ok.teachers[0].serving == "swap"
