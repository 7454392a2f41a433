"""On-policy distillation (§7): the teacher scores the student's sampled tokens; the advantage is the
negative sampled reverse KL per token (γ = 0), optionally added to a task advantage:
  A_t = - λ_opd ( log π_θ(y_t) - log π_T(y_t) ) [+ A_task]
It feeds the PPO / IcePop loss unchanged.
"""

from __future__ import annotations

import torch

from slime_dsa.algorithms.utils import per_sample_sum, upcast


def opd_advantages(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    opd_coef: float = 1.0,
    task_advantages: torch.Tensor | None = None,
) -> torch.Tensor:
    """(T,) detached per-token advantage, 0 where loss_mask is 0."""
    for name, t in (("teacher_logprobs", teacher_logprobs), ("loss_mask", loss_mask), ("task_advantages", task_advantages)):
        if t is not None and t.shape != student_logprobs.shape:
            raise ValueError(f"{name} must have shape {tuple(student_logprobs.shape)} like student_logprobs, got {tuple(t.shape)}")
    advantages = -opd_coef * (upcast(student_logprobs) - upcast(teacher_logprobs)).detach()
    if task_advantages is not None:
        advantages = advantages + upcast(task_advantages).detach()
    return advantages * loss_mask


def reverse_kl_per_sample(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, loss_mask: torch.Tensor, sample_index: torch.Tensor
) -> torch.Tensor:
    """(N,) mean over each sample's generated tokens of log π_θ - log π_T, for per-domain logging."""
    diff = (upcast(student_logprobs) - upcast(teacher_logprobs)).detach() * loss_mask
    return per_sample_sum(diff, sample_index) / per_sample_sum(upcast(loss_mask), sample_index).clamp(min=1.0)
