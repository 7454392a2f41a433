"""Masked reductions over packed token tensors.

Every per-token tensor is (T,) over the concatenated tokens of a batch; `mask` (T,) is float (1 on tokens
that count, e.g. the loss mask) and `sample_index` (T,) long says which sample each token belongs to.
"""

from __future__ import annotations

from typing import Literal

import torch

Aggregation = Literal["token_mean", "seq_mean"]
AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean")


def upcast(x: torch.Tensor) -> torch.Tensor:
    """Losses are computed in at least float32 (bf16/fp16 log-probs are upcast, float64 kept)."""
    return x if x.dtype == torch.float64 else x.float()


def sample_index_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(S+1,) cumulative sequence lengths -> (T,) sample index of every token."""
    lens = cu_seqlens.diff()
    return torch.repeat_interleave(torch.arange(len(lens), device=cu_seqlens.device), lens)


def num_samples(sample_index: torch.Tensor) -> int:
    """Number of samples a (T,) sample index spans (max + 1; 0 for no tokens)."""
    return int(sample_index.max()) + 1 if sample_index.numel() else 0


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ_t values_t · mask_t, a 0-d tensor."""
    return (values * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor, denominator: float | torch.Tensor | None = None) -> torch.Tensor:
    """Σ_t values_t · mask_t / Σ_t mask_t (or / denominator); 0 when nothing is masked in."""
    if denominator is None:
        denominator = mask.sum().clamp(min=1.0)
    return masked_sum(values, mask) / denominator


def per_sample_sum(values: torch.Tensor, sample_index: torch.Tensor, n_samples: int | None = None) -> torch.Tensor:
    """(T,) -> (N,) sum of each sample's tokens."""
    n = num_samples(sample_index) if n_samples is None else n_samples
    return values.new_zeros(n).index_add(0, sample_index, values)


def seq_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    sample_index: torch.Tensor,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked mean of each sample, then the mean over samples that have a masked-in token (or / denominator)."""
    sums = per_sample_sum(values * mask, sample_index)  # (N,)
    counts = per_sample_sum(mask.to(values.dtype), sample_index)  # (N,)
    per_sample = sums / counts.clamp(min=1.0)
    if denominator is None:
        denominator = (counts > 0).sum().clamp(min=1).to(values.dtype)
    return per_sample.sum() / denominator


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    sample_index: torch.Tensor,
    aggregation: Aggregation = "token_mean",
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar by token mean (DAPO, default) or sequence mean.

    `denominator` replaces this batch's own count (masked tokens, or samples with a masked token) so that
    micro-batches of one step can each be divided by the whole step's count and their gradients add up.
    """
    if aggregation == "token_mean":
        return masked_mean(values, mask, denominator)
    if aggregation == "seq_mean":
        return seq_mean(values, mask, sample_index, denominator)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
