"""On-policy distillation (§7): the teacher scores the student's sampled tokens; the advantage is the
negative sampled reverse KL per token (γ = 0), optionally added to a task advantage:
  A_t = - λ_opd ( log π_θ(y_t) - log π_T(y_t) ) [+ A_task]
It feeds the PPO / IcePop loss unchanged. In a batch that mixes domains, a sample without a teacher (a reward
domain) keeps its task advantage alone (`mixed_advantages`). With the top-k transfer option the teacher's part is
not an advantage but a sparse KL over its top-k ids plus a tail bucket, added to the loss (`TopKDistillPPOLoss`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slime_dsa.algorithms.ppo import PPOLoss
from slime_dsa.algorithms.topk_kl import KLDirection, sparse_topk_kl, topk_tail_metrics
from slime_dsa.algorithms.types import LossInputs
from slime_dsa.algorithms.utils import masked_mean, per_sample_sum, upcast


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


def mixed_advantages(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    sample_index: torch.Tensor,
    taught: torch.Tensor,
    task_advantages: torch.Tensor,
    opd_coef: float = 1.0,
    add_task_advantage: bool = False,
    sampled_estimate: bool = True,
) -> torch.Tensor:
    """(T,) per-token advantages of a batch mixing teacher domains and reward domains.

    taught (N,) bool: the sample's domain has a teacher; task_advantages (N,): e.g. group advantages of the
    rewards. A sample without a teacher gets its task advantage; a taught one gets the sampled reverse-KL advantage
    (sampled_estimate; off with the top-k KL, which the loss adds instead) plus, with add_task_advantage, its task
    advantage. 0 where loss_mask is 0.
    """
    if taught.shape != task_advantages.shape:
        raise ValueError(f"taught {tuple(taught.shape)} and task_advantages {tuple(task_advantages.shape)} must both "
                         "be (N,)")
    taught_tokens = taught.to(sample_index.device)[sample_index].to(loss_mask.dtype)  # (T,)
    keep_task = 1.0 - taught_tokens * (0.0 if add_task_advantage else 1.0)
    advantages = upcast(task_advantages).detach()[sample_index] * keep_task
    if sampled_estimate:
        advantages = advantages + opd_advantages(student_logprobs, teacher_logprobs, loss_mask * taught_tokens,
                                                 opd_coef)
    return advantages * loss_mask


def reverse_kl_per_sample(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, loss_mask: torch.Tensor, sample_index: torch.Tensor
) -> torch.Tensor:
    """(N,) mean over each sample's generated tokens of log π_θ - log π_T, for per-domain logging."""
    diff = (upcast(student_logprobs) - upcast(teacher_logprobs)).detach() * loss_mask
    return per_sample_sum(diff, sample_index) / per_sample_sum(upcast(loss_mask), sample_index).clamp(min=1.0)


@dataclass(frozen=True)
class TopKDistillPPOLoss(PPOLoss):
    """The PPO / GRPO surrogate plus distill_coef · the sparse top-k KL (topk_kl.py) on rows that have candidates.

    The KL term is differentiated directly (not through the ratio); rows with candidate_mask 0 and batches without
    candidates (a rank's padding pass) add nothing to it.
    """

    distill_coef: float = 1.0  # λ_opd
    kl_direction: KLDirection = "reverse"  # reverse = KL(student ‖ teacher), the OPD objective

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.distill_coef < 0:
            raise ValueError(f"distill_coef must be >= 0, got {self.distill_coef}")
        if self.kl_direction not in ("reverse", "forward"):
            raise ValueError(f"kl_direction must be reverse or forward, got {self.kl_direction!r}")

    def per_token(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, metrics = super().per_token(inputs)
        if inputs.candidate_logprobs is None:
            zero = loss.new_zeros(())
            metrics.update({"topk_kl": zero, "topk_tail_student": zero, "topk_tail_teacher": zero})
            return loss, metrics
        rows = upcast(inputs.candidate_mask)
        kl = sparse_topk_kl(inputs.candidate_logprobs, inputs.candidate_target_logprobs, self.kl_direction)  # (T,)
        counted = rows * inputs.loss_mask
        metrics["topk_kl"] = masked_mean(kl.detach(), counted)
        metrics.update(topk_tail_metrics(inputs.candidate_logprobs, inputs.candidate_target_logprobs, counted))
        return loss + self.distill_coef * kl * rows, metrics
