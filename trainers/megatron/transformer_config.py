"""megatron-core's TransformerConfig for a GLM-MoE-DSA shape: the MoE, router and parallel settings its pieces read."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from slime_dsa.models.config import ModelConfig
from slime_dsa.models.parallel_layout import ParallelSizes


def check_router(config: ModelConfig) -> None:
    """Refuse, in one line, a router megatron-core computes differently from transformers."""
    if not config.norm_topk_prob and config.num_experts_per_tok > 1:
        raise ValueError("trainer.backend megatron needs norm_topk_prob true (megatron's sigmoid router always "
                         "normalises the top-k weights)")
    limited = config.topk_group < config.n_group
    if limited and config.num_experts_per_tok // config.topk_group != 2:
        raise ValueError(f"trainer.backend megatron scores a group by its top num_experts_per_tok / topk_group "
                         f"({config.num_experts_per_tok} / {config.topk_group}) experts; transformers by its top 2")


def transformer_config(config: ModelConfig, sizes: ParallelSizes, params_dtype: torch.dtype) -> TransformerConfig:
    """Everything megatron-core's embedding, linear, MLP and MoE modules read; attention and norms are ours."""
    check_router(config)
    tp = sizes.tensor_parallel
    shared = config.moe_intermediate_size * config.n_shared_experts
    limited = config.topk_group < config.n_group
    return TransformerConfig(
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, ffn_hidden_size=config.intermediate_size,
        init_method_std=config.initializer_range, layernorm_epsilon=config.rms_norm_eps, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        # MoE: sigmoid scores, a fixed selection bias (e_score_correction_bias), normalised top-k times the routed
        # scaling factor, no auxiliary loss; all-gather dispatch (all-to-all needs CUDA streams).
        num_moe_experts=config.n_routed_experts, moe_ffn_hidden_size=config.moe_intermediate_size,
        moe_router_topk=config.num_experts_per_tok, moe_shared_expert_intermediate_size=shared or None,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_router_dtype="fp32",
        moe_router_topk_scaling_factor=config.routed_scaling_factor,
        moe_router_num_groups=config.n_group if limited else None,
        moe_router_group_topk=config.topk_group if limited else None,
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
        # Parallelism: experts split by expert parallelism only (ETP 1); TP with MoE needs sequence parallelism.
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=sizes.pipeline_parallel,
        expert_model_parallel_size=sizes.expert_parallel, expert_tensor_parallel_size=1,
        context_parallel_size=sizes.context_parallel, sequence_parallel=tp > 1,
        params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(), perform_initialization=False,  # HF weights load next
    )
