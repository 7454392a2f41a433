"""The bodies of SGLang's weight-update endpoints besides /update_weights_from_tensor, with its field names.

Field names follow sgl-project/sglang python/sglang/srt/managers/io_struct.py (InitWeightsUpdateGroupReqInput,
UpdateWeightsFromDistributedReqInput, UpdateWeightFromDiskReqInput). Our embedded server takes the disk body too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch

DEFAULT_GROUP = "weight_update_group"


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's dtype spelling: 'bfloat16', not 'torch.bfloat16'."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver allocates before a broadcast: the tensor's name, dtype (SGLang's spelling) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        import torch  # noqa: PLC0415

        n = getattr(torch, self.dtype).itemsize
        for d in self.shape:
            n *= d
        return n


def bucket_specs(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive specs grouped into buckets of at most `bucket_bytes` (a larger tensor stands alone)."""
    buckets: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if buckets[-1] and size + spec.nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(spec)
        size += spec.nbytes
    return buckets if buckets[0] else []


def init_weights_update_group_payload(master_address: str, master_port: int, rank_offset: int, world_size: int,
                                      group_name: str = DEFAULT_GROUP, backend: str = "nccl") -> dict:
    """Body of POST /init_weights_update_group for one engine; its ranks are rank_offset .. rank_offset+tp-1."""
    return {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}


def update_weights_from_distributed_payload(specs: Sequence[TensorSpec], *, group_name: str = DEFAULT_GROUP,
                                            flush_cache: bool = True, weight_version: str | None = None,
                                            load_format: str | None = None,
                                            abort_all_requests: bool = False) -> dict:
    """Body of POST /update_weights_from_distributed: the tensors broadcast next, in this order."""
    payload = {
        "names": [s.name for s in specs],
        "dtypes": [s.dtype for s in specs],
        "shapes": [list(s.shape) for s in specs],
        "group_name": group_name,
        "flush_cache": flush_cache,
        "abort_all_requests": abort_all_requests,
        "weight_version": weight_version,
    }
    if load_format is not None:
        payload["load_format"] = load_format
    return payload


def update_weights_from_disk_payload(model_path: str, *, weight_version: str | None = None,
                                     load_format: str | None = None, abort_all_requests: bool = False) -> dict:
    """Body of POST /update_weights_from_disk."""
    return {"model_path": str(model_path), "load_format": load_format, "abort_all_requests": abort_all_requests,
            "weight_version": weight_version}
