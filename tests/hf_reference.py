"""Helpers that build random transformers GlmMoeDsaForCausalLM checkpoints: the reference our model must match.

index_n_heads is 16 because an index score is exactly 0 when every head's ReLU is 0 (probability 2^-heads per
key); torch.topk breaks such exact ties in no fixed order, while our rule is deterministic (lower position wins).
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(
    vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=10, n_group=1,
    topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, index_topk=6, index_head_dim=16,
    index_n_heads=16, max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def hf_config(**overrides):
    from transformers import GlmMoeDsaConfig

    kwargs = {**TINY, **overrides}
    kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    return GlmMoeDsaConfig(**kwargs)


def make_hf_checkpoint(directory: Path, seed: int = 0, **overrides) -> "torch.nn.Module":
    """Save a randomly initialised HF GlmMoeDsaForCausalLM (float32, eager attention) and return it."""
    from transformers import GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    config = hf_config(**overrides)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # the reference loop; grouped_mm rejects odd strides
    model = GlmMoeDsaForCausalLM(config).float().eval()
    with torch.no_grad():  # a non-zero load-balancing bias exercises e_score_correction_bias
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(directory)
    return model


def make_served_model(directory: Path, seed: int = 0) -> Path:
    """make_hf_checkpoint sized for the built-in tokenizer, with that tokenizer saved beside it: a directory that
    `serve` and the engines load."""
    from slime_dsa.data.tokenizer import MODEL_VOCAB_SIZE, build_tokenizer, save_tokenizer

    make_hf_checkpoint(directory, seed=seed, vocab_size=MODEL_VOCAB_SIZE, eos_token_id=build_tokenizer().eos_token_id)
    save_tokenizer(directory)
    return directory
