"""Value-model (critic) loss with value clipping, and explained variance (SAO, §5).

  V_clip = V_old + clip(V - V_old, -ε_v, ε_v)
  L_V = ½ · aggregate( max( (V - R)², (V_clip - R)² ) )
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slime_dsa.algorithms.types import LossOutputs
from slime_dsa.algorithms.utils import AGGREGATIONS, Aggregation, aggregate, masked_mean, upcast


@dataclass
class ValueLossInputs:
    """Per-token tensors (T,) of a packed batch; values are scored on action tokens (loss_mask = 1)."""

    values: torch.Tensor  # (T,) V(s_t) of the critic being trained (carries the gradient)
    old_values: torch.Tensor  # (T,) V_old(s_t) at the start of the step
    returns: torch.Tensor  # (T,) value targets R_t
    loss_mask: torch.Tensor  # (T,) float
    sample_index: torch.Tensor  # (T,) long
    denominator: float | torch.Tensor | None = None  # as in LossInputs

    def __post_init__(self) -> None:
        for name in ("old_values", "returns", "loss_mask", "sample_index"):
            if getattr(self, name).shape != self.values.shape:
                raise ValueError(f"{name} must have shape {tuple(self.values.shape)} like values, got {tuple(getattr(self, name).shape)}")


MIN_RETURN_VARIANCE = 1e-8  # below it every target is the same: explained variance is undefined


def masked_variance(x: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Var(x) over masked tokens."""
    return masked_mean((x - masked_mean(x, loss_mask)) ** 2, loss_mask)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over masked tokens; 1 is perfect, 0 no better than the mean, < 0 worse."""
    values, returns = upcast(values.detach()), upcast(returns.detach())
    var_r = masked_variance(returns, loss_mask)
    return 1.0 - masked_variance(returns - values, loss_mask) / var_r.clamp(min=MIN_RETURN_VARIANCE)


@dataclass(frozen=True)
class ValueLoss:
    """Clipped squared-error value loss."""

    value_clip: float | None = 0.2  # ε_v; None turns clipping off
    aggregation: Aggregation = "token_mean"

    def __post_init__(self) -> None:
        if self.value_clip is not None and self.value_clip <= 0:
            raise ValueError(f"value_clip must be > 0 (or None), got {self.value_clip}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")

    def __call__(self, inputs: ValueLossInputs) -> LossOutputs:
        values, old, returns = upcast(inputs.values), upcast(inputs.old_values).detach(), upcast(inputs.returns).detach()
        mask = inputs.loss_mask
        loss_t = (values - returns) ** 2
        metrics: dict[str, torch.Tensor] = {}
        if self.value_clip is not None:
            clipped = old + (values - old).clamp(-self.value_clip, self.value_clip)
            loss_clipped = (clipped - returns) ** 2
            metrics["vf_clipfrac"] = masked_mean((loss_clipped > loss_t).float(), mask).detach()
            loss_t = torch.maximum(loss_t, loss_clipped)
        loss = 0.5 * aggregate(loss_t, mask, inputs.sample_index, self.aggregation, inputs.denominator)
        metrics["value_loss"] = loss.detach()
        metrics["explained_variance"] = explained_variance(values, returns, mask)
        metrics["value_mean"] = masked_mean(values.detach(), mask)
        metrics["returns_mean"] = masked_mean(returns, mask)
        return LossOutputs(loss=loss, metrics=metrics)
