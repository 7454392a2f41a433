"""On-policy distillation, parallel over domains (docs/algorithms.md section 7): the synchronous loop and GRPO's loss,
with per-token advantages from each sample's domain teacher.

  taught sample:    A_t = − opd_coef · (log π_roll(y_t) − log π_T(y_t))  [+ its group advantage]
  reward domain:    A_t = its group advantage (GRPO), so one batch can mix both
With opd_topk > 0 each teacher also returns its top-k log-probs per position and the teacher's part becomes a
sparse KL over those k ids plus a tail bucket, added to the loss (TopKDistillPPOLoss) instead of an advantage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slime_dsa.algorithms.specs.base import AdvantageInputs
from slime_dsa.algorithms.specs.grpo import GRPO

if TYPE_CHECKING:
    import torch

    from slime_dsa.algorithms.policy_loss import PolicyLoss


class OPD(GRPO):
    """Teacher advantages per token (reverse KL to the domain's teacher), group advantages for reward domains."""

    name = "opd"
    loop = "sync"
    advantage_source = "teacher"
    advantage_level = "token"
    min_group_size = 1
    options = GRPO.options | {"opd_coef", "opd_topk", "opd_task_advantage"}

    @property
    def teacher_topk(self) -> int:
        return self.section.opd_topk

    def advantages(self, inputs: AdvantageInputs) -> torch.Tensor:
        from slime_dsa.algorithms.opd import mixed_advantages  # noqa: PLC0415

        mask, index, student, teacher, taught = inputs.teacher_inputs()
        s = self.section
        return mixed_advantages(student, teacher, mask, index, taught, super().advantages(inputs),
                                opd_coef=s.opd_coef, add_task_advantage=s.opd_task_advantage,
                                sampled_estimate=s.opd_topk == 0)

    def advantage_metrics(self, inputs: AdvantageInputs) -> dict[str, float]:
        mask, _, student, teacher, taught = inputs.teacher_inputs()
        taught_tokens = taught[inputs.sample_index].float() * mask
        count = float(taught_tokens.sum())
        kl = float(((student - teacher) * taught_tokens).sum()) / count if count else float("nan")
        return {"teacher_reverse_kl": kl, "taught_frac": float(taught.float().mean()) if len(taught) else 0.0}

    def policy_loss(self) -> PolicyLoss:
        loss = super().policy_loss()
        if self.section.opd_topk == 0:
            return loss
        from dataclasses import asdict  # noqa: PLC0415

        from slime_dsa.algorithms.opd import TopKDistillPPOLoss  # noqa: PLC0415

        return TopKDistillPPOLoss(**asdict(loss), distill_coef=self.section.opd_coef)
