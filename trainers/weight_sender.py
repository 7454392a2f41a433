"""A trainer's side of weight sync, the same for every backend: write the weights to a file, or broadcast them
to the engines' process group from rank 0.

Backends hand in their model's state dict: plain tensors, or DTensors (FSDP2) whose whole tensor each rank
gathers in turn. Every rank walks the same names in the same order, because a gather is a collective.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from slime_dsa.models.glm_moe_dsa import GlmMoeDsaForCausalLM
from slime_dsa.weights.cuda_ipc import DTYPES
from slime_dsa.weights.payloads import TensorSpec, dtype_name
from trainers.process_group import free_port


def engine_dtypes(config: Any, engine_dtype: str) -> dict[str, torch.dtype]:
    """name -> the dtype an engine loaded with `engine_dtype` keeps that tensor in (built on the meta device)."""
    if engine_dtype not in DTYPES:
        raise ValueError(f"engine dtype must be one of {sorted(DTYPES)}, got {engine_dtype!r}")
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(config)
    model.cast(DTYPES[engine_dtype])
    return {name: t.dtype for name, t in model.state_dict().items()}


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor's gathered (a collective), a plain tensor as it is."""
    if not isinstance(t, DTensor):
        return t
    if t.device_mesh.size() == 1:  # on a one-rank mesh the local shard already is the whole tensor
        local = t.to_local()
        if local.shape == t.shape:
            return local
    return t.full_tensor()


def write_safetensors(state: Mapping[str, torch.Tensor], path: str) -> None:
    """Write `state` to the safetensors file `path` atomically: readers see the old file or the new one."""
    from safetensors.torch import save_file  # noqa: PLC0415

    seen: set[int] = set()
    tensors = {}
    for name, t in state.items():
        t = t.detach().contiguous()
        if t.data_ptr() in seen:  # tied weights: safetensors refuses shared storage
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[name] = t
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file(tensors, tmp)
    os.replace(tmp, path)


def weight_specs(model: torch.nn.Module, engine_dtype: str | None = None) -> list[TensorSpec]:
    """Name, dtype and shape of every tensor of the state dict as it is sent: cast to the dtype an engine with
    `engine_dtype` keeps it in (None: as the trainer holds it)."""
    targets = engine_dtypes(model.config, engine_dtype) if engine_dtype is not None else {}
    return [TensorSpec(name, dtype_name(targets.get(name, t.dtype)), tuple(t.shape))
            for name, t in model.state_dict().items()]


def sent_tensors(state: Mapping[str, torch.Tensor], specs: Sequence[TensorSpec]) -> Iterator[torch.Tensor]:
    """Each spec's whole tensor, cast to its dtype, in order. Collective: call on every rank."""
    for spec in specs:
        t = full_tensor(state[spec.name])
        yield t.to(getattr(torch, spec.dtype)).contiguous()


@torch.no_grad()
def broadcast_weights(state: Mapping[str, torch.Tensor], buckets: Sequence[Sequence[TensorSpec]],
                      group: Any | None) -> None:
    """Send every tensor of `buckets`, in order, from rank 0 of `group` (the rank that holds `group`; other trainer
    ranks pass None and only take part in the gathers)."""
    for bucket in buckets:
        for tensor in sent_tensors(state, bucket):
            if group is not None:
                dist.broadcast(tensor, src=0, group=group)



def group_address() -> tuple[str, int]:
    """(this node's address the engines reach, a free port): where rank 0 hosts the weight-update group."""
    ray = sys.modules.get("ray")  # a Ray actor has imported it; a process that never did is not in a cluster
    host = ray.util.get_node_ip_address() if ray is not None and ray.is_initialized() else "127.0.0.1"
    return host, free_port()
