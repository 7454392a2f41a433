"""How the model is sharded (kept apart from what the model is): each decoder layer compiled when asked
(trainer.compile), then FSDP2 per decoder layer, then the root: torchtitan's order."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from slime_dsa.models.fused_pointwise import allow_compiled_variants
from slime_dsa.models.glm_moe_dsa import GlmMoeDsaPreTrainedModel, float32_modules


COMPILED_VARIANTS = 64  # dynamo's recompile limit while layers are compiled (apply_compile)


def apply_compile(model: GlmMoeDsaPreTrainedModel) -> None:
    """torch.compile each decoder layer's forward (MTP layers included), in place, as torchtitan's apply_compile
    compiles each transformer block: the layers share one code object, so a compiled graph serves every layer of
    its kind (dense or MoE MLP, indexer or IndexShare attention).

    The forward, not the module's __call__ (nn.Module.compile): FSDP2's hooks, registered on the layer afterwards by
    apply_fsdp, then run around the compiled graphs, as around torchtitan's compiled block, instead of breaking them.
    The parameters, their names and the state dict are unchanged. dynamic=True: packed micro-batches change the
    token count and the number of sequences every step, and with dynamic shapes from the first call a new length
    reuses the graphs instead of recompiling them once more (automatic dynamic's second compile). The DSA ops
    (slime_dsa.ops) and, in float32, the grouped experts run eagerly between the graphs (graph breaks)."""
    # One code object serves every layer (and each piece between graph breaks is one more), with a compiled variant
    # per combination of what its graphs branch on, not per shape: layer kind (dense or MoE MLP, indexer or
    # IndexShare), grad mode (the π_old pass runs without), capture (the indexer loss), replay, an index_topk
    # override. The quickstart preset's π_old pass, training and indexer-loss forward took one such piece past
    # dynamo's default limit of 8 variants, past which it runs eagerly, with only a log line (CPU, 2026-12-06).
    allow_compiled_variants(COMPILED_VARIANTS)
    # The floats a layer reads (its norms' eps, the router's routed_scaling_factor) as constants of its graphs. Under
    # dynamic=True dynamo otherwise passes each as a 0-d CPU tensor input, and inductor's CUDA code reads it with
    # .item() at every kernel launch that uses it: a host sync each. They never change, so no recompile follows.
    torch._dynamo.config.specialize_float = True
    # Inductor fuses a norm backward's row and column reductions ("mix-order reduction") only above a size, and under
    # dynamic shapes that size check becomes a guard on the token count: the warm-up's small packs compiled one
    # variant, a step's full micro-batches another in the first step, and a size past a second threshold would compile
    # a third mid-run. Without the fusion no graph branches on the token count.
    import torch._inductor.config as inductor_config  # noqa: PLC0415 - only where trainer.compile is on

    if hasattr(inductor_config.triton, "mix_order_reduction"):
        inductor_config.triton.mix_order_reduction = False
    for layer in model.model.layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)


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
