"""One step's on-policy distillation, for algorithms whose advantages come from a teacher: the per-token
advantages from the teachers' scores (and the teachers' top-k as the batch's candidates for the loss's sparse KL),
and the per-domain metrics.

Metrics: opd/<domain>/reverse_kl (mean over generated tokens of log π_roll − log π_teacher, the sampled estimate of
KL(student ‖ teacher) per token), opd/<domain>/reward (the student's task reward), opd/<domain>/teacher_logprob (the
teacher's mean log-prob per token of the student's samples: its score of them), and teacher/<name>/... (what each
teacher's scoring took: rollout/teachers/stats.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from slime_dsa.algorithms.specs import AdvantageInputs, Algorithm
from slime_dsa.data.sample import Sample

if TYPE_CHECKING:
    from trainers.base import TrainBatch


def teacher_advantage_inputs(samples: list[Sample], batch: TrainBatch, taught: list[bool]) -> AdvantageInputs:
    """What a teacher's per-token advantages read: rewards and groups, the batch's loss mask, sample index and π_roll,
    and the teachers' log-probs laid out like the batch (0 on prompt rows and on untaught samples)."""
    teacher = []
    for sample, has_teacher in zip(samples, taught):
        if has_teacher and sample.teacher_logprobs is None:
            raise ValueError(f"sample {sample.index} of domain '{sample.task}' has no teacher scores")
        scores = sample.teacher_logprobs if has_teacher else [0.0] * sample.response_length
        teacher += [0.0] * len(sample.prompt_ids) + list(scores)
    rewards = torch.tensor([float(s.reward or 0.0) for s in samples], dtype=torch.float32)
    group_ids = torch.tensor([s.group_id if s.group_id is not None else s.index for s in samples])
    sample_index = torch.repeat_interleave(torch.arange(len(batch.seqlens)), torch.tensor(batch.seqlens))
    return AdvantageInputs(rewards=rewards, group_ids=group_ids, loss_mask=batch.loss_mask, sample_index=sample_index,
                           rollout_logprobs=batch.rollout_logprobs, teacher_logprobs=torch.tensor(teacher),
                           taught=torch.tensor(taught, dtype=torch.bool))


def attach_candidates(batch: TrainBatch, samples: list[Sample], k: int) -> None:
    """The teachers' top-k of every response token as the batch's candidates (ids, log-probs, rows that have them)."""
    total = sum(batch.seqlens)
    ids = torch.zeros(total, k, dtype=torch.long)
    target = torch.zeros(total, k, dtype=torch.float32)
    rows = torch.zeros(total, dtype=torch.float32)
    start = 0
    for sample in samples:
        first = start + len(sample.prompt_ids)
        if sample.teacher_topk_ids is not None:
            if sample.teacher_topk_ids.shape[1] != k:
                raise ValueError(f"sample {sample.index}: the teacher returned {sample.teacher_topk_ids.shape[1]} "
                                 f"top log-probs per token, expected {k}")
            end = first + sample.response_length
            ids[first:end] = torch.from_numpy(sample.teacher_topk_ids).long()
            target[first:end] = torch.from_numpy(sample.teacher_topk_logprobs).float()
            rows[first:end] = torch.tensor(sample.loss_mask, dtype=torch.float32)
        start += sample.total_length
    batch.candidate_ids, batch.candidate_target_logprobs, batch.candidate_mask = ids, target, rows


def domain_metrics(samples: list[Sample], teacher_of: dict[str, str | None]) -> dict[str, float]:
    """opd/<domain>/... of the step's samples (see the module docstring); reward domains get their reward only."""
    out: dict[str, float] = {}
    for domain in sorted({s.task for s in samples}):
        mine = [s for s in samples if s.task == domain]
        out[f"opd/{domain}/reward"] = sum(float(s.reward or 0.0) for s in mine) / len(mine)
        scored = [s for s in mine if s.teacher_logprobs is not None]
        if teacher_of.get(domain) is None or not scored:
            continue
        diff = teacher_sum = tokens = 0.0
        for s in scored:
            for mask, student, teacher in zip(s.loss_mask, s.rollout_logprobs, s.teacher_logprobs):
                if mask:
                    diff += student - teacher
                    teacher_sum += teacher
                    tokens += 1
        out[f"opd/{domain}/reverse_kl"] = diff / max(tokens, 1.0)
        out[f"opd/{domain}/teacher_logprob"] = teacher_sum / max(tokens, 1.0)
    return out


def teacher_estimates(spec: Algorithm, pool: Any, batch: TrainBatch, samples: list[Sample]) -> dict[str, float]:
    """Fill batch.advantages (per token) from the teachers, and the candidates with the top-k option; the step's
    advantage/, opd/ and teacher/ metrics (the teachers' counters start again)."""
    from slime_dsa.algorithms.gae import advantage_metrics  # noqa: PLC0415
    from slime_dsa.algorithms.utils import masked_mean  # noqa: PLC0415

    teacher_of = {s.task: pool.teacher_of(s.task) for s in samples}
    inputs = teacher_advantage_inputs(samples, batch, [teacher_of[s.task] is not None for s in samples])
    batch.advantages = spec.advantages(inputs).float()
    if spec.teacher_topk:
        attach_candidates(batch, samples, spec.teacher_topk)
    stats = advantage_metrics(batch.advantages, batch.loss_mask)
    metrics = {"advantage/mean": float(masked_mean(batch.advantages, batch.loss_mask)),
               "advantage/std": float(stats["advantage_std"]), "advantage/abs_mean": float(stats["advantage_abs_mean"])}
    metrics.update({f"advantage/{k}": v for k, v in spec.advantage_metrics(inputs).items()})
    metrics.update(domain_metrics(samples, teacher_of))
    metrics.update(pool.metrics())
    pool.reset_metrics()
    return metrics
