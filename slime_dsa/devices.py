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


def upload_many(tensors: Sequence[torch.Tensor | None], device: torch.device | str) -> list[torch.Tensor | None]:
    """upload() of each tensor (None stays None); host tensors bound for a GPU travel together, through one pinned
    buffer and one copy: each pinned allocation and copy of its own cost the host ~0.1 ms."""
    device = torch.device(device)
    host = [i for i, t in enumerate(tensors) if t is not None and t.device.type == "cpu"]
    if device.type != "cuda" or len(host) < 2:
        return [None if t is None else upload(t, device) for t in tensors]
    staged, offsets = pack_bytes([tensors[i] for i in host], pin_memory=True)
    arrived = unpack_bytes(staged.to(device, non_blocking=True), [tensors[i] for i in host], offsets)
    out = [None if t is None or t.device.type == "cpu" else upload(t, device) for t in tensors]
    for i, tensor in zip(host, arrived):
        out[i] = tensor
    return out


def pack_bytes(tensors: Sequence[torch.Tensor], pin_memory: bool = False) -> tuple[torch.Tensor, list[int]]:
    """The tensors' bytes in one uint8 buffer, each at a 16-byte aligned offset (any dtype's view is aligned there);
    returns the buffer and the offsets (unpack_bytes reads them back)."""
    offsets, total = [], 0
    for tensor in tensors:
        total = -(-total // 16) * 16
        offsets.append(total)
        total += tensor.numel() * tensor.element_size()
    buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pin_memory)
    for tensor, offset in zip(tensors, offsets):
        nbytes = tensor.numel() * tensor.element_size()
        buffer[offset:offset + nbytes].view(tensor.dtype).copy_(tensor.reshape(-1))
    return buffer, offsets


def unpack_bytes(buffer: torch.Tensor, like: Sequence[torch.Tensor], offsets: Sequence[int]) -> list[torch.Tensor]:
    """Views of `buffer` (from pack_bytes, or its copy on a device) with the dtypes and shapes of `like`."""
    return [buffer[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for t, offset in zip(like, offsets)]


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
