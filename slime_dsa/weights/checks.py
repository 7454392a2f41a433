"""The checks a weight update passes before anything is applied: every tensor named as the model names it, of its
shape, floating point (cast to the model's dtype on copy) and finite. Pure: the engine runs them on its thread."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

from slime_dsa.weights import WeightFormatError

if TYPE_CHECKING:
    import torch


def check_update(state_dict: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor],
                 finite_spans: Sequence[torch.Tensor] | None = None) -> None:
    """WeightFormatError naming the first tensor of `state_dict` that cannot replace its namesake in `params`.

    finite_spans: views that together hold every value of `state_dict` (a shared buffer's runs of one dtype,
    slime_dsa.weights.cuda_ipc.float_spans): checked for NaN and infinity first, the tensors one by one only when a
    span holds one (in a tensor, named, or in padding between them)."""
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
    if finite_spans is None or not all(_finite_flags(finite_spans)):
        _check_finite(state_dict)


def _check_finite(state_dict: Mapping[str, torch.Tensor]) -> None:
    """WeightFormatError naming the first tensor with a NaN or an infinity."""
    flags = _finite_flags(list(state_dict.values()))
    if not all(flags):
        name = list(state_dict)[flags.index(False)]
        raise WeightFormatError(f"tensor {name} holds NaN or infinite values")


def _finite_flags(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """Whether each tensor holds only finite values. Each tensor's largest |x| (NaN or inf exactly when the tensor
    holds one) comes from one foreach call per device and dtype, read with one host sync per device: a launch and a
    sync per tensor cost the update hundreds of round trips on a GPU."""
    import math  # noqa: PLC0415

    import torch  # noqa: PLC0415

    groups: dict[torch.device, dict[torch.dtype, list[tuple[int, torch.Tensor]]]] = {}
    for i, tensor in enumerate(tensors):
        if tensor.numel():  # an empty tensor holds no value (and has no infinity norm)
            groups.setdefault(tensor.device, {}).setdefault(tensor.dtype, []).append((i, tensor))
    flags = [True] * len(tensors)
    for by_dtype in groups.values():
        order = [i for same in by_dtype.values() for i, _ in same]
        finite = torch.cat([torch.stack(torch._foreach_norm([t for _, t in same], ord=math.inf)).float().isfinite()
                            for same in by_dtype.values()])
        if not bool(finite.all()):
            for j, ok in enumerate(finite.tolist()):
                flags[order[j]] = ok
    return flags
