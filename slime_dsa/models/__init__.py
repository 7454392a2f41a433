"""GLM-MoE-DSA in plain PyTorch."""

from slime_dsa.models.config import ModelConfig, derive_indexer_types
from slime_dsa.models.glm_moe_dsa import GlmMoeDsaForCausalLM, KVCache, ModelOutput, PackedBatch
from slime_dsa.models.logprobs import chunked_token_logprobs
from slime_dsa.models.value_model import GlmMoeDsaForValue

__all__ = [
    "ModelConfig", "derive_indexer_types", "GlmMoeDsaForCausalLM", "GlmMoeDsaForValue", "KVCache", "ModelOutput",
    "PackedBatch", "chunked_token_logprobs",
]
