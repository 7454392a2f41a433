"""Whole tensors out of ZeRO's partitions, a bucket at a time, in state-dict order.

Stages 1 and 2 keep whole parameters on every rank. ZeRO-3 gathers one bucket of parameters (GatheredParameters: an
all-gather, so every rank walks the same names in the same order) and partitions it again before the next: no rank
holds more than a bucket beyond what its caller keeps.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Iterable, Iterator

import torch
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
