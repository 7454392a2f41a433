"""Entropy of the policy over generated tokens; the model computes per-token entropies, this aggregates."""

from __future__ import annotations

import torch

from slime_dsa.algorithms.utils import Aggregation, aggregate, upcast


def entropy_mean(
    entropy: torch.Tensor, loss_mask: torch.Tensor, sample_index: torch.Tensor, aggregation: Aggregation = "token_mean"
) -> torch.Tensor:
    """Masked mean of per-token entropies (T,) -> (), aggregated like the loss."""
    return aggregate(upcast(entropy), loss_mask, sample_index, aggregation)
