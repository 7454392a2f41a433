"""Named model sizes for runs that start from scratch (model.path: null) and for benchmarks."""

from __future__ import annotations

from typing import Any

from slime_dsa.models.config import ModelConfig

_SMALL_COMMON = dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=4096,
                     eos_token_id=None, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)

PRESETS: dict[str, dict[str, Any]] = {
    # ~0.2M parameters: CI tests.
    "tiny": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                 v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                 index_n_heads=4, index_head_dim=16, index_topk=16, indexer_types=["full", "shared"]),
    # ~2M parameters: the CPU quickstart policy.
    "quickstart": dict(hidden_size=128, intermediate_size=384, moe_intermediate_size=96, num_hidden_layers=4,
                       num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16,
                       qk_rope_head_dim=8, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
                       first_k_dense_replace=1, index_n_heads=8, index_head_dim=16, index_topk=32,
                       indexer_types=["full", "shared", "full", "shared"]),
    # ~160M parameters: one-GPU recipes (recipes/gpu_single.yaml).
    "small": dict(hidden_size=768, intermediate_size=2048, moe_intermediate_size=256, num_hidden_layers=8,
                  num_attention_heads=12, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64,
                  qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=32, num_experts_per_tok=4,
                  first_k_dense_replace=1, index_n_heads=16, index_head_dim=64, index_topk=256,
                  indexer_types=["full", "shared", "shared", "shared"] * 2),
}


def preset_config(name: str, vocab_size: int, eos_token_id: int | None = None, **overrides: Any) -> ModelConfig:
    """A ModelConfig of a named preset for a tokenizer of `vocab_size` tokens."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return ModelConfig(**{**_SMALL_COMMON, **PRESETS[name], "vocab_size": vocab_size, "eos_token_id": eos_token_id, **overrides})
