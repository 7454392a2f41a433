"""Weight sync with real SGLang servers: the exact HTTP payloads of its update endpoints, and the NCCL side.

Field names follow sgl-project/sglang python/sglang/srt/managers/io_struct.py (InitWeightsUpdateGroupReqInput,
UpdateWeightsFromDistributedReqInput, UpdateWeightsFromTensorReqInput, UpdateWeightFromDiskReqInput).

- from distributed (trainer and engines on different GPUs/nodes): POST /init_weights_update_group to every
  engine while the trainer joins the same group as rank 0; then, per bucket, POST
  /update_weights_from_distributed (names, dtypes without "torch.", shapes) while the trainer broadcasts each
  tensor from rank 0 in `names` order. `broadcast_to_engines` does both halves in that order.
- from tensor (colocated, same node): SGLang's payload is base64 of a torch multiprocessing pickle (CUDA IPC
  handles). We only ever build it, for a real SGLang peer; nothing here parses one.
- from disk: a path every engine can read.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import io
import logging
from datetime import timedelta
from typing import Any, Iterable, Sequence

import torch

logger = logging.getLogger(__name__)

DEFAULT_GROUP = "weight_update_group"


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's dtype spelling: 'bfloat16', not 'torch.bfloat16'."""
    return str(dtype).removeprefix("torch.")


def init_weights_update_group_payload(master_address: str, master_port: int, rank_offset: int, world_size: int,
                                      group_name: str = DEFAULT_GROUP, backend: str = "nccl") -> dict:
    """Body of POST /init_weights_update_group for one engine; its ranks are rank_offset .. rank_offset+tp-1."""
    return {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}


def update_weights_from_distributed_payload(named_tensors: Sequence[tuple[str, torch.Tensor]], *,
                                            group_name: str = DEFAULT_GROUP, flush_cache: bool = True,
                                            weight_version: str | None = None, load_format: str | None = None,
                                            abort_all_requests: bool = False) -> dict:
    """Body of POST /update_weights_from_distributed: metadata of the tensors broadcast next, in this order."""
    payload = {
        "names": [name for name, _ in named_tensors],
        "dtypes": [dtype_name(t.dtype) for _, t in named_tensors],
        "shapes": [list(t.shape) for _, t in named_tensors],
        "group_name": group_name,
        "flush_cache": flush_cache,
        "abort_all_requests": abort_all_requests,
        "weight_version": weight_version,
    }
    if load_format is not None:
        payload["load_format"] = load_format
    return payload


def destroy_weights_update_group_payload(group_name: str = DEFAULT_GROUP) -> dict:
    return {"group_name": group_name}


def update_weights_from_disk_payload(model_path: str, *, weight_version: str | None = None,
                                     load_format: str | None = None, abort_all_requests: bool = False) -> dict:
    """Body of POST /update_weights_from_disk."""
    return {"model_path": str(model_path), "load_format": load_format, "abort_all_requests": abort_all_requests,
            "weight_version": weight_version}


def update_weights_from_tensor_payload(named_tensors: Sequence[tuple[str, torch.Tensor]], *, tp_size: int = 1,
                                       flush_cache: bool = True, weight_version: str | None = None,
                                       abort_all_requests: bool = False) -> dict:
    """Body of POST /update_weights_from_tensor in SGLang's own format (load_format null: a list of (name, tensor)).

    Each entry is base64 of torch's ForkingPickler dump, as sglang.srt.utils.MultiprocessingSerializer writes
    it; CUDA tensors travel as IPC handles, so the receiver must be on the same node. One entry per TP rank.
    Only for a real SGLang peer: our embedded server refuses this format (it never unpickles HTTP input).
    """
    import torch.multiprocessing  # noqa: F401  (registers the tensor reducers with ForkingPickler)
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(list(named_tensors))
    entry = base64.b64encode(buf.getvalue()).decode("ascii")
    return {"serialized_named_tensors": [entry] * tp_size, "load_format": None, "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests, "weight_version": weight_version}


def init_weight_update_group(master_address: str, master_port: int, world_size: int, *, rank: int = 0,
                             group_name: str = DEFAULT_GROUP, backend: str = "nccl",
                             timeout: timedelta = timedelta(minutes=10)) -> Any:
    """Join a process group apart from the default one (the trainer is rank 0, engine ranks follow).

    Built the way SGLang's own `init_custom_process_group` builds it (TCP rendezvous, PrefixStore,
    `_new_process_group_helper`), so both sides meet in one group. "nccl" on GPU; "gloo" works on CPU.
    """
    from torch.distributed.distributed_c10d import (
        Backend, PrefixStore, _new_process_group_helper, _world, rendezvous,
    )

    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    params = inspect.signature(_new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                         timeout=timeout, **{options: None})
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


async def broadcast_to_engines(
    client: Any,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    master_address: str,
    master_port: int,
    engine_tp_sizes: Sequence[int],
    group_name: str = DEFAULT_GROUP,
    backend: str = "nccl",
    weight_version: str | None = None,
    bucket_bytes: int = 1024**3,
    group: Any = None,
) -> Any:
    """Send weights to SGLang engines over NCCL from trainer rank 0, in SGLang's order; returns the group.

    Order: (1) POST /init_weights_update_group to every engine and join as rank 0 at once (both block until
    the rendezvous completes); (2) per bucket, POST /update_weights_from_distributed (the metadata) and
    broadcast each tensor in `names` order. `client` is a rollout.client.EngineClient over the engines, in
    the order of `engine_tp_sizes`. Pass `group` from an earlier call to skip step (1).
    """
    import torch.distributed as dist

    urls = list(client.engines)
    if len(urls) != len(engine_tp_sizes):
        raise ValueError(f"engine_tp_sizes has {len(engine_tp_sizes)} entries but the client has {len(urls)} engines")
    if group is None:
        world_size = 1 + sum(engine_tp_sizes)
        offsets = [1 + sum(engine_tp_sizes[:i]) for i in range(len(urls))]
        posts = [
            client.post_to(url, "/init_weights_update_group",
                               init_weights_update_group_payload(master_address, master_port, off, world_size,
                                                                 group_name, backend))
            for url, off in zip(urls, offsets)
        ]
        join = asyncio.to_thread(init_weight_update_group, master_address, master_port, world_size,
                                 group_name=group_name, backend=backend)
        *_, group = await asyncio.gather(*posts, join)

    from slime_dsa.checkpoint.hf_format import split_by_bytes

    buckets = split_by_bytes(named_tensors, bucket_bytes)

    def send(bucket: list[tuple[str, torch.Tensor]]) -> None:
        for _, tensor in bucket:
            dist.broadcast(tensor.contiguous(), src=0, group=group)

    for i, bucket in enumerate(buckets):
        last = i == len(buckets) - 1
        payload = update_weights_from_distributed_payload(bucket, group_name=group_name, flush_cache=last,
                                                          weight_version=weight_version if last else None)
        await asyncio.gather(client.broadcast("/update_weights_from_distributed", payload),
                             asyncio.to_thread(send, bucket))
    return group
