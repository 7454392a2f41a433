"""PPO / GRPO clipped surrogate with Clip-Higher, dual clip, and IcePop / TIS mismatch corrections (§2, §3).

  r = π_θ / π_old,  L_t = - w_t · min( r A, clip(r, 1 - ε_low, 1 + ε_high) A )
  dual clip (A < 0 only): L_t = min( that, -c A )
  w_t = 1 (none) | M(k) IcePop | min(k, C) TIS, with k = π_old / π_roll
Bypass mode uses π_roll as π_old (no recomputation at step start); k is then 1 and no correction applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from slime_dsa.algorithms.is_correction import icepop_weights, mismatch_log_ratio, mismatch_metrics, tis_weights
from slime_dsa.algorithms.policy_loss import PolicyLoss, ratio_from_logprobs, ratio_metrics
from slime_dsa.algorithms.types import LossInputs
from slime_dsa.algorithms.utils import masked_mean, upcast

ISCorrection = Literal["none", "icepop", "tis"]
IS_CORRECTIONS: tuple[str, ...] = ("none", "icepop", "tis")


@dataclass(frozen=True)
class PPOLoss(PolicyLoss):
    """Clipped policy-gradient loss; defaults are DAPO's Clip-Higher without mismatch correction."""

    eps_low: float = 0.2  # lower clip: r >= 1 - eps_low
    eps_high: float = 0.28  # upper clip: r <= 1 + eps_high (Clip-Higher)
    dual_clip: float | None = None  # c > 1: bound the loss of A < 0 tokens at -c·A (3.0 is usual); None = off
    is_correction: ISCorrection = "none"  # none | icepop | tis, weights from k = π_old / π_roll
    icepop_alpha: float = 0.5  # IcePop keeps tokens with alpha <= k <= beta
    icepop_beta: float = 2.0
    tis_cap: float = 2.0  # TIS weight min(k, tis_cap)
    bypass: bool = False  # use rollout_logprobs as old_logprobs (π_old := π_roll)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low}")
        if self.eps_high < 0.0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (or None), got {self.dual_clip}")
        if self.is_correction not in IS_CORRECTIONS:
            raise ValueError(f"is_correction must be one of {IS_CORRECTIONS}, got {self.is_correction!r}")
        if not 0.0 <= self.icepop_alpha <= 1.0 <= self.icepop_beta:
            raise ValueError(f"icepop_alpha ({self.icepop_alpha}) <= 1 <= icepop_beta ({self.icepop_beta}) is required, with alpha >= 0")
        if self.tis_cap <= 0.0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")
        if self.bypass and self.is_correction != "none":
            raise ValueError(f"is_correction={self.is_correction!r} has no effect with bypass=True (π_old = π_roll, k = 1); drop one")

    def per_token(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.bypass or self.is_correction != "none":
            if inputs.rollout_logprobs is None:
                why = "bypass=True" if self.bypass else f"is_correction={self.is_correction!r}"
                raise ValueError(f"rollout_logprobs is required with {why}")
        old = inputs.rollout_logprobs if self.bypass else inputs.old_logprobs
        if old is None:
            raise ValueError("old_logprobs is required unless bypass=True")
        mask = inputs.loss_mask
        adv = upcast(inputs.advantages).detach()
        ratio = ratio_from_logprobs(inputs.logprobs, old)  # (T,)
        loss_unclipped = -adv * ratio
        loss_clipped = -adv * ratio.clamp(1.0 - self.eps_low, 1.0 + self.eps_high)
        loss = torch.maximum(loss_unclipped, loss_clipped)  # = -min(rA, clip(r)A)
        metrics = ratio_metrics(ratio, mask)
        r, negative = ratio.detach(), adv < 0
        metrics["pg_clipfrac"] = masked_mean((loss_clipped > loss_unclipped).float(), mask).detach()
        metrics["pg_clipfrac_low"] = masked_mean((negative & (r < 1.0 - self.eps_low)).float(), mask)
        metrics["pg_clipfrac_high"] = masked_mean(((adv > 0) & (r > 1.0 + self.eps_high)).float(), mask)
        if self.dual_clip is not None:
            loss_dual = -adv * self.dual_clip
            dual_active = negative & (loss_dual < loss.detach())
            loss = torch.where(negative, torch.minimum(loss, loss_dual), loss)
            metrics["pg_clipfrac_dual"] = masked_mean(dual_active.float(), mask)
        if inputs.rollout_logprobs is not None and not self.bypass:
            log_k = mismatch_log_ratio(old, inputs.rollout_logprobs)
            metrics.update(mismatch_metrics(log_k, mask))
            if self.is_correction == "icepop":
                weight, dropped = icepop_weights(log_k, self.icepop_alpha, self.icepop_beta)
                loss = weight * loss  # dropped tokens stay in the denominator
                metrics["icepop_mask_frac"] = masked_mean(dropped.float(), mask)
            elif self.is_correction == "tis":
                weight, capped = tis_weights(log_k, self.tis_cap)
                loss = weight * loss
                metrics["tis_clip_frac"] = masked_mean(capped.float(), mask)
        elif inputs.rollout_logprobs is not None:
            metrics.update(mismatch_metrics(mismatch_log_ratio(inputs.logprobs, inputs.rollout_logprobs), mask))
        return loss, metrics
