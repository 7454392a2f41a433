"""Moving host tensors to a GPU without stalling the host."""

from __future__ import annotations

import torch


def upload(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` on `device`. Host tensors go to a GPU through pinned memory and return at once: a plain `.to()` from
    pageable memory waits until every kernel queued before it has run, so the host cannot queue ahead."""
    device = torch.device(device)
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
