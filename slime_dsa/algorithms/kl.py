"""Per-token KL estimators between the policy and a reference model (Schulman, "Approximating KL").

With log_ratio = log π_θ(y) - log π_ref(y) on tokens sampled from π_θ, each estimates KL(π_θ ‖ π_ref):
  k1 = log_ratio                                  unbiased, high variance, can be negative
  k2 = ½ log_ratio²                                biased, low variance
  k3 = exp(-log_ratio) - 1 + log_ratio            unbiased, low variance, >= 0
  low_var_kl = k3 with log_ratio clamped to ±20 and the result to [-10, 10] (verl's low_var_kl)
"""

from __future__ import annotations

from typing import Literal

import torch

from slime_dsa.algorithms.utils import upcast

KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "low_var_kl")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "low_var_kl") -> torch.Tensor:
    """(T,) per-token estimate of KL(π_θ ‖ π_ref); aggregate it like the policy loss."""
    log_ratio = upcast(logprobs) - upcast(ref_logprobs)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    if estimator == "low_var_kl":
        log_ratio = log_ratio.clamp(-20.0, 20.0)
        return (torch.exp(-log_ratio) - 1.0 + log_ratio).clamp(-10.0, 10.0)
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
