"""The value model (critic) of SAO (docs/algorithms.md section 5): the policy's backbone with a scalar head.

- Backbone: GlmMoeDsaModel under `model.`, named as in the policy, so a policy checkpoint initialises it as is
  (its lm_head and MTP layers are left out).
- Head: `value_head`, a Linear(hidden_size, 1) with bias on the final-norm hidden states, computed in float32.
- Trained: MLP/MoE blocks, the decoder norms, the final norm and the head. Frozen (VALUE_FROZEN): the attention
  (MLA projections, their norms and the DSA indexer, all under `self_attn.`) and the token embedding.
Values are laid out like log-probs: row t is V(s_t), the value of the state in which token t is chosen (the tokens
before it), read from the hidden state of row t - 1; the first row of each sequence is 0.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from slime_dsa.models.config import ModelConfig
from slime_dsa.models.glm_moe_dsa import GlmMoeDsaPreTrainedModel, PackedBatch

VALUE_ARCHITECTURE = "GlmMoeDsaForValue"  # config.json "architectures" of a value model directory
VALUE_HEAD = "value_head"
# Parameters of the value model that stay fixed: matched as substrings of parameter names (RoleConfig.frozen).
VALUE_FROZEN = (".self_attn.", "model.embed_tokens.")


def is_value_model_dir(path: str | Path) -> bool:
    """Whether path/config.json names the value model's architecture (False where it is unreadable)."""
    try:
        architectures = json.loads((Path(path) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return VALUE_ARCHITECTURE in architectures


def value_config(policy: ModelConfig) -> ModelConfig:
    """The value model's config from the policy's: the same backbone without MTP layers (no next-token heads),
    saved with architectures GlmMoeDsaForValue."""
    return dataclasses.replace(policy, num_nextn_predict_layers=0, tie_word_embeddings=False,  # no lm_head to tie
                               extra={**policy.extra, "architectures": [VALUE_ARCHITECTURE]})


def fresh_value_head(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """A new head's tensors as init_weights draws any Linear (normal(0, initializer_range), bias 0), from a generator
    of its own: every rank draws the same head."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(1, config.hidden_size, generator=generator) * config.initializer_range
    return {f"{VALUE_HEAD}.weight": weight, f"{VALUE_HEAD}.bias": torch.zeros(1)}


class GlmMoeDsaForValue(GlmMoeDsaPreTrainedModel):
    """Per-token state values over packed sequences."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.value_head = nn.Linear(config.hidden_size, 1, bias=True)

    def token_values(self, input_ids: torch.Tensor, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(values (T,), final (S,)) float32: values[t] = V(s_t) before token t (0 at each sequence's first token);
        final[s] = V after the last token of sequence s (the bootstrap of a trajectory cut by a limit)."""
        out = self.forward_hidden(input_ids, batch)
        head = self.value_head
        after = F.linear(out.hidden_states.float(), head.weight.float(), head.bias.float()).squeeze(-1)  # (T,)
        values = torch.roll(after, 1)  # row t-1's state is the one token t is chosen in
        values[batch.cu_seqlens_q[:-1]] = 0.0
        final = after[batch.cu_seqlens_q[1:] - 1]  # (S,)
        return values, final

    def cast(self, dtype: torch.dtype) -> GlmMoeDsaForValue:
        """As the policy's cast, with the head kept in float32 (one number per token: keep its precision)."""
        super().cast(dtype)
        self.value_head.float()
        return self
