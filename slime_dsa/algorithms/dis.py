"""Asynchronous REINFORCE with direct double-sided importance sampling (GLM-5 §3.3, SAO; §4).

No π_old: the ratio is taken against the policy that sampled each token, whatever its version.
  r = π_θ / π_roll,  f(r) = r if 1 - ε_l < r < 1 + ε_h else 0
  L = - token_mean( sg(f(r)) · A · log π_θ )
Implemented as - token_mean( 1[in range] · r · A ), which has that gradient and a meaningful value:
out-of-range tokens give exactly zero gradient whatever the sign of A.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slime_dsa.algorithms.is_correction import mismatch_log_ratio, mismatch_metrics
from slime_dsa.algorithms.policy_loss import PolicyLoss, ratio_from_logprobs, ratio_metrics
from slime_dsa.algorithms.types import LossInputs
from slime_dsa.algorithms.utils import masked_mean, upcast


@dataclass(frozen=True)
class DISLoss(PolicyLoss):
    """Double-sided IS policy gradient; defaults are the SAO paper's math setting (code: 0.8 / 3.0)."""

    eps_low: float = 0.3  # tokens with r <= 1 - eps_low get no gradient
    eps_high: float = 5.0  # tokens with r >= 1 + eps_high get no gradient

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.eps_low <= 1.0:
            raise ValueError(f"eps_low must be in (0, 1], got {self.eps_low}")
        if self.eps_high <= 0.0:
            raise ValueError(f"eps_high must be > 0, got {self.eps_high}")

    def per_token(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if inputs.rollout_logprobs is None:
            raise ValueError("rollout_logprobs is required by the DIS loss (the ratio is π_θ / π_roll)")
        mask = inputs.loss_mask
        adv = upcast(inputs.advantages).detach()
        ratio = ratio_from_logprobs(inputs.logprobs, inputs.rollout_logprobs)  # (T,)
        r = ratio.detach()
        below, above = r <= 1.0 - self.eps_low, r >= 1.0 + self.eps_high
        in_range = ~(below | above)
        loss = -torch.where(in_range, ratio * adv, torch.zeros_like(ratio))
        metrics = ratio_metrics(ratio, mask)
        metrics["dis_frac_below"] = masked_mean(below.float(), mask)
        metrics["dis_frac_above"] = masked_mean(above.float(), mask)
        # With π_old at hand this is the pure train–inference mismatch; without it, staleness is mixed in.
        base = inputs.old_logprobs if inputs.old_logprobs is not None else inputs.logprobs
        metrics.update(mismatch_metrics(mismatch_log_ratio(base, inputs.rollout_logprobs), mask))
        return loss, metrics
