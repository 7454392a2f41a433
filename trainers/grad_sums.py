"""Gradient sums in a wider dtype, in foreach ops: shared by the bf16 copy (trainers/fsdp/bf16_compute.py) and
Megatron's main gradients (trainers/megatron/main_grads.py)."""

from __future__ import annotations

import torch


def add_gradients(first: list[tuple[torch.Tensor, torch.Tensor]], later: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each (sum, grad) pair of `first` into its sum and add each pair of `later` to its sum, casting to the sum's
    dtype (bf16 widens to float32 exactly); one launch per group where dtypes agree."""
    if first:
        torch._foreach_copy_([s for s, _ in first], [g for _, g in first])
    if later:  # mixed dtypes take foreach's per-tensor path
        torch._foreach_add_([s for s, _ in later], [g for _, g in later])
