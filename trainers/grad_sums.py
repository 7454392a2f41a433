"""Gradient sums in a wider dtype, in foreach ops: shared by the bf16 copy (trainers/fsdp/bf16_compute.py) and
Megatron's main gradients (trainers/megatron/main_grads.py)."""

from __future__ import annotations

import torch

from slime_dsa.devices import foreach_copy


def add_gradients(first: list[tuple[torch.Tensor, torch.Tensor]], later: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each (sum, grad) pair of `first` into its sum and add each pair of `later` to its sum, casting to the sum's
    dtype (bf16 widens to float32 exactly). One foreach call per (sum dtype, grad dtype, device): on CUDA a list mixing
    the float32 routers' gradients with the bf16 rest leaves the fused kernels for one launch per tensor."""
    if first:
        foreach_copy([s for s, _ in first], [g for _, g in first])
    groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for total, grad in later:
        sums, grads = groups.setdefault((total.dtype, grad.dtype, total.device), ([], []))
        sums.append(total)
        grads.append(grad)
    for sums, grads in groups.values():  # a group whose dtypes differ still takes foreach's per-tensor path
        torch._foreach_add_(sums, grads)
