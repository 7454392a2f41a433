"""The checks a weight update passes before anything is applied: every tensor named as the model names it, of its
shape, floating point (cast to the model's dtype on copy) and finite. Pure: the engine runs them on its thread."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from slime_dsa.weights import WeightFormatError

if TYPE_CHECKING:
    import torch


def check_update(state_dict: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> None:
    """WeightFormatError naming the first tensor of `state_dict` that cannot replace its namesake in `params`."""
    import torch  # noqa: PLC0415

    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise WeightFormatError(f"tensor {name} is a {type(tensor).__name__}, not a tensor")
        if name not in params:
            raise WeightFormatError(f"the model has no tensor named {name}")
        target = params[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise WeightFormatError(f"tensor {name} has shape {tuple(tensor.shape)}, the model expects "
                                    f"{tuple(target.shape)}")
        if not tensor.is_floating_point():
            raise WeightFormatError(f"tensor {name} is {str(tensor.dtype).removeprefix('torch.')}; weights must be "
                                    f"floating point (the model holds {str(target.dtype).removeprefix('torch.')})")
    _check_finite(state_dict)


def _check_finite(state_dict: Mapping[str, torch.Tensor]) -> None:
    """WeightFormatError naming the first tensor with a NaN or an infinity. One flag per tensor on its device, read
    with one host sync per device (on a GPU a sync per tensor cost the update hundreds of round trips)."""
    import torch  # noqa: PLC0415

    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in state_dict.items():
        by_device.setdefault(tensor.device, []).append((name, tensor))
    for items in by_device.values():
        flags = torch.stack([torch.isfinite(tensor).all() for _, tensor in items])
        if not bool(flags.all()):
            bad = items[flags.tolist().index(False)][0]
            raise WeightFormatError(f"tensor {bad} holds NaN or infinite values")
