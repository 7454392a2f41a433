"""Moving host tensors to a GPU without stalling the host, and copying many tensors in few launches."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` on `device`. Host tensors go to a GPU through pinned memory and return at once: a plain `.to()` from
    pageable memory waits until every kernel queued before it has run, so the host cannot queue ahead."""
    device = torch.device(device)
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def foreach_copy(destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """destination.copy_(source) for every pair (casting as copy_ does), in one torch._foreach_copy_ per (destination
    dtype, source dtype, device): on CUDA a list that mixes dtypes (the float32 routers among bf16 weights) leaves the
    fused copy for one launch per tensor, ~1,000 launches for a model's weights."""
    groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for destination, source in zip(destinations, sources, strict=True):
        key = (destination.dtype, source.dtype, destination.device, source.device)
        group = groups.setdefault(key, ([], []))
        group[0].append(destination)
        group[1].append(source)
    for group_destinations, group_sources in groups.values():
        torch._foreach_copy_(group_destinations, group_sources)
