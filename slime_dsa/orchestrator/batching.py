"""Samples → the trainer's packed TrainBatch: advantages, loss masks and per-token rollout log-probs."""

from __future__ import annotations

import torch

from slime_dsa.algorithms import group_advantages, group_centered_advantages
from slime_dsa.data.sample import Sample
from trainers.base import TrainBatch


def sample_advantages(samples: list[Sample], algorithm: str, std_normalize: bool) -> torch.Tensor:
    """One advantage per sample: group-normalised (GRPO) or group-centred (async REINFORCE)."""
    rewards = torch.tensor([float(s.reward or 0.0) for s in samples], dtype=torch.float32)
    group_ids = torch.tensor([s.group_id if s.group_id is not None else s.index for s in samples])
    if algorithm == "grpo":
        return group_advantages(rewards, group_ids=group_ids, normalize_std=std_normalize)
    return group_centered_advantages(rewards, group_ids=group_ids)


def build_train_batch(samples: list[Sample], advantages: torch.Tensor) -> TrainBatch:
    """Pack prompt+response of every sample; only response tokens the policy generated are trained on."""
    ids, mask, rollout_logp, adv, seqlens = [], [], [], [], []
    for sample, a in zip(samples, advantages.tolist()):
        n_prompt, n_resp = len(sample.prompt_ids), len(sample.response_ids)
        ids.extend(sample.tokens)
        mask.extend([0.0] * n_prompt + [float(m) for m in sample.loss_mask])
        rollout_logp.extend([0.0] * n_prompt + list(sample.rollout_logprobs))
        adv.extend([a] * (n_prompt + n_resp))
        seqlens.append(n_prompt + n_resp)
    return TrainBatch(
        input_ids=torch.tensor(ids, dtype=torch.long), seqlens=seqlens,
        loss_mask=torch.tensor(mask, dtype=torch.float32), rollout_logprobs=torch.tensor(rollout_logp, dtype=torch.float32),
        advantages=torch.tensor(adv, dtype=torch.float32),
    )


def logprob_abs_diff(batch: TrainBatch) -> float:
    """Mean |log π_old − log π_roll| over the batch's trained tokens: a silent weight-sync error shows here."""
    if batch.old_logprobs is None:
        return float("nan")
    tokens = batch.loss_mask.sum().clamp(min=1)
    return float(((batch.old_logprobs - batch.rollout_logprobs).abs() * batch.loss_mask).sum() / tokens)
