"""Whole tensors out of ZeRO's partitions, a bucket at a time, in state-dict order; and back into them.

Stages 1 and 2 keep whole parameters on every rank. ZeRO-3 gathers one bucket of parameters (GatheredParameters: an
all-gather, so every rank walks the same names in the same order) and partitions it again before the next: no rank
holds more than a bucket beyond what its caller keeps.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from slime_dsa.weights.payloads import TensorSpec, dtype_name
from trainers.weight_sender import engine_dtypes

DEFAULT_BUCKET_BYTES = 256 << 20


def full_shape(t: torch.Tensor) -> tuple[int, ...]:
    """A tensor's whole shape (a ZeRO-3 partition keeps it as ds_shape)."""
    return tuple(t.ds_shape) if hasattr(t, "ds_shape") else tuple(t.shape)


def _nbytes(t: torch.Tensor) -> int:
    return int(torch.Size(full_shape(t)).numel()) * t.element_size()


def state_entries(model: nn.Module) -> dict[str, torch.Tensor]:
    """name -> the parameter or buffer itself (not a copy), in state-dict order."""
    return model.state_dict(keep_vars=True)


def weight_specs(model: nn.Module, engine_dtype: str | None = None) -> list[TensorSpec]:
    """trainers.weight_sender.weight_specs for partitioned models: whole shapes, cast for `engine_dtype`."""
    targets = engine_dtypes(model.config, engine_dtype) if engine_dtype is not None else {}
    return [TensorSpec(name, dtype_name(targets.get(name, t.dtype)), full_shape(t))
            for name, t in state_entries(model).items()]


def whole_tensors(model: nn.Module, names: Iterable[str] | None = None,
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) of `names` (default: the whole state dict), in order. A yielded tensor is valid until
    the next one is asked for: copy what you keep. Collective under ZeRO-3."""
    import deepspeed  # noqa: PLC0415

    entries = state_entries(model)
    wanted = [(name, entries[name]) for name in (names if names is not None else entries)]
    for bucket in _buckets(wanted, bucket_bytes):
        partitioned = list({id(t): t for _, t in bucket if hasattr(t, "ds_id")}.values())  # tied weights once
        with deepspeed.zero.GatheredParameters(partitioned) if partitioned else nullcontext():
            for name, t in bucket:
                yield name, t.detach()


def _buckets(entries: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket, size = [], 0
    for name, t in entries:
        if bucket and size + _nbytes(t) > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += _nbytes(t)
    if bucket:
        yield bucket


@torch.no_grad()
def write_whole_tensors(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into the model's parameters and buffers (ZeRO-3: into each rank's partition). Collective."""
    import deepspeed  # noqa: PLC0415

    entries = model.state_dict(keep_vars=True)
    for key, t in entries.items():
        value = state[key]
        if hasattr(t, "ds_id"):  # every rank writes the same value; rank 0's is partitioned again on exit
            with deepspeed.zero.GatheredParameters([t], modifier_rank=0):
                t.data.copy_(value)
        else:
            t.data.copy_(value)


def set_full(p: torch.nn.Parameter, value: torch.Tensor, key: str | None) -> None:
    """Write a trainable parameter's float32 master weight (key None) or optimizer moment from its full tensor."""
    import deepspeed  # noqa: PLC0415

    if not hasattr(p, "ds_id"):
        if key is None:
            deepspeed.utils.safe_set_full_fp32_param(p, value.to(p.device))
        else:
            deepspeed.utils.safe_set_full_optimizer_state(p, value.to(p.device), key)
        return
    # ZeRO-3: this rank's slice of the flattened tensor, zero-padded like its partition (DeepSpeed's full setter
    # reads past the end of a tensor whose size the ranks do not divide).
    n = p.ds_tensor.numel()
    flat = torch.zeros(n * dist.get_world_size(), dtype=torch.float32)
    flat[: value.numel()] = value.flatten()
    local = flat[n * dist.get_rank(): n * (dist.get_rank() + 1)]
    if key is None:
        deepspeed.utils.safe_set_local_fp32_param(p, local)
    else:
        deepspeed.utils.safe_set_local_optimizer_state(p, local, key)
