"""The whole HF state dict from the ranks' shards (for weight sync, export and checkpoints): every TP-split tensor
is all-gathered over the tensor-parallel group, every expert over the expert-parallel group, then convert.py merges."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from slime_dsa.models.config import ModelConfig
from trainers.megatron.convert import megatron_to_hf, split_kinds


def _gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def local_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The rank's own tensors by Megatron name (no megatron `_extra_state` placeholders, no non-persistent buffers)."""
    return {k: v.detach() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def gather_hf_state(model: torch.nn.Module, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The full HF state dict, float32 on CPU, on every rank. Collective over the whole group."""
    return gather_hf(local_state(model), config)


def local_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The rank's gradients by Megatron name, laid out as its state (zeros where a tensor has none)."""
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {n: grads[n] if n in grads else torch.zeros_like(t) for n, t in local_state(model).items()}


@torch.no_grad()
def gather_hf(local: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Whole HF-named tensors from every rank's Megatron-named ones (weights or gradients), float32 on CPU, on
    every rank. Collective over the whole group."""
    tp, ep = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_expert_model_parallel_world_size()
    kinds = split_kinds(config, ep)
    tp_group, ep_group = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_expert_model_parallel_group()
    tp_parts, ep_parts = {}, {}
    for name in sorted(local):  # the same order on every rank
        kind = kinds[name]
        if kind == "tp" and tp > 1:
            tp_parts[name] = _gather(local[name], tp_group)
        elif kind == "ep" and ep > 1:
            ep_parts[name] = _gather(local[name], ep_group)
    shards = {}
    for t in range(tp):
        for e in range(ep):
            shard = dict(local)
            shard.update({n: parts[t] for n, parts in tp_parts.items()})
            shard.update({n: parts[e] for n, parts in ep_parts.items()})
            shards[t, e] = shard
    return {k: v.float().cpu() for k, v in megatron_to_hf(shards, config, tp, ep).items()}


def load_shard(model: torch.nn.Module, shard: dict[str, torch.Tensor]) -> None:
    """Copy a rank's Megatron state into the model; every tensor must be there, nothing extra."""
    expected = local_state(model)
    missing, extra = sorted(set(expected) - set(shard)), sorted(set(shard) - set(expected))
    if missing or extra:
        raise ValueError(f"Megatron state does not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        for name, tensor in expected.items():
            if tuple(tensor.shape) != tuple(shard[name].shape):
                raise ValueError(f"{name}: shape {tuple(shard[name].shape)}, the model expects {tuple(tensor.shape)}")
            tensor.copy_(shard[name])
