"""The shared frame of every policy loss: per-token surrogate -> aggregate -> optional KL and entropy terms.

A policy loss is a frozen dataclass of its hyper-parameters, called on `LossInputs`. Subclasses define
`per_token`, the surrogate loss of every token (T,) and their own metrics; this class aggregates it and adds
  + kl_coef · aggregate(KL(π_θ ‖ π_ref))      (off by default: kl_coef = 0, as in GLM-5 / DAPO)
  - entropy_coef · aggregate(entropy)          (off by default)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slime_dsa.algorithms.kl import KL_ESTIMATORS, KLEstimator, kl_estimate
from slime_dsa.algorithms.types import LossInputs, LossOutputs
from slime_dsa.algorithms.utils import AGGREGATIONS, Aggregation, aggregate, masked_mean, upcast

# exp of a log-ratio beyond this overflows or is meaningless; clamp as verl does.
MAX_LOG_RATIO = 20.0


def ratio_from_logprobs(logprobs: torch.Tensor, base_logprobs: torch.Tensor) -> torch.Tensor:
    """r = exp(log π_θ - log π_base), computed in log space (clamped to ±20); (T,) with π_θ's gradient."""
    return torch.exp((upcast(logprobs) - upcast(base_logprobs).detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def ratio_metrics(ratio: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean and max ratio, and k3 estimate of KL(π_base ‖ π_θ) = E[(r - 1) - log r], over generated tokens."""
    ratio = ratio.detach()
    return {
        "ratio_mean": masked_mean(ratio, loss_mask),
        "ratio_max": (ratio * (loss_mask > 0)).max() if ratio.numel() else ratio.new_zeros(()),
        "approx_kl": masked_mean(ratio - 1.0 - torch.log(ratio), loss_mask),
    }


@dataclass(frozen=True)
class PolicyLoss:
    """Hyper-parameters every policy loss shares."""

    aggregation: Aggregation = "token_mean"  # token_mean (DAPO, default) or seq_mean (mean of per-sample means)
    kl_coef: float = 0.0  # weight of the KL penalty to the reference model; needs ref_logprobs when > 0
    kl_estimator: KLEstimator = "low_var_kl"  # k1 | k2 | k3 | low_var_kl
    entropy_coef: float = 0.0  # weight of the entropy bonus; needs entropy when > 0

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef}")

    def per_token(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(T,) surrogate loss of every token (before masking) and the loss's own metrics."""
        raise NotImplementedError

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        per_token, metrics = self.per_token(inputs)
        mask, index = inputs.loss_mask, inputs.sample_index
        pg_loss = aggregate(per_token, mask, index, self.aggregation, inputs.denominator)
        loss = pg_loss
        metrics["pg_loss"] = pg_loss.detach()
        if self.kl_coef > 0 and inputs.ref_logprobs is None:
            raise ValueError(f"ref_logprobs is required when kl_coef > 0 (kl_coef={self.kl_coef})")
        if inputs.ref_logprobs is not None:
            kl = aggregate(kl_estimate(inputs.logprobs, inputs.ref_logprobs, self.kl_estimator), mask, index, self.aggregation, inputs.denominator)
            metrics["kl_ref"] = kl.detach()
            if self.kl_coef > 0:
                loss = loss + self.kl_coef * kl
        if self.entropy_coef > 0 and inputs.entropy is None:
            raise ValueError(f"entropy is required when entropy_coef > 0 (entropy_coef={self.entropy_coef})")
        if inputs.entropy is not None:
            entropy = aggregate(upcast(inputs.entropy), mask, index, self.aggregation, inputs.denominator)
            metrics["entropy"] = masked_mean(inputs.entropy.float().detach(), mask)
            if self.entropy_coef > 0:
                loss = loss - self.entropy_coef * entropy
        metrics["loss"] = loss.detach()
        return LossOutputs(loss=loss, metrics=metrics)
