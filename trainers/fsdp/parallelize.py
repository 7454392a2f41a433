"""How the model is sharded (kept apart from what the model is): FSDP2 per decoder layer, then the root."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from slime_dsa.models.glm_moe_dsa import GlmMoeDsaPreTrainedModel, float32_modules


def apply_fsdp(model: GlmMoeDsaPreTrainedModel, mesh: DeviceMesh, mixed_precision: bool,
               entry_points: tuple[str, ...] = ("token_logprobs",)) -> GlmMoeDsaPreTrainedModel:
    """Shard every decoder layer and the root with FSDP2; bf16 compute with float32 reduction when asked, the
    routers and indexer heads (float32_modules) then sharded on their own to compute from their float32 values."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else MixedPrecisionPolicy()
    if mixed_precision:  # a policy holds for a whole shard group: these need their own, in float32
        for module in float32_modules(model):
            fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32,
                                                                          reduce_dtype=torch.float32))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    # The trainer enters through methods other than forward (token_logprobs, token_values): FSDP must gather the
    # root's weights there too.
    for name in entry_points:
        register_fsdp_forward_method(model, name)
    return model
