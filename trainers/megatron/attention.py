"""Our DSA attention as the self-attention of a Megatron layer: MLA + lightning indexer + sparse attention
(slime_dsa.models' MLAttention, its math unchanged), over this rank's share of the heads.

Under tensor parallelism the layer's input arrives split along the sequence (sequence parallelism) and is gathered:
every rank computes the low-rank projections, their norms and the indexer on the whole sequence (replicated
weights), then attends with its H / tp heads; o_proj is megatron's RowParallelLinear, which reduce-scatters the
heads' sum back to sequence shards (at TP 1 its weight goes through torch's linear, as MLAttention's o_proj). The
replicated projections feed only this rank's heads, so their gradients are partial sums: they carry megatron's
`sequence_parallel` mark, which finalize_model_grads all-reduces over TP. The indexer's gradient comes only from the
indexer loss, computed whole on every rank from every head's attention (`gather_heads`), so it is already complete
and is not marked.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    RowParallelLinear,
    gather_from_sequence_parallel_region,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from slime_dsa.models.config import ModelConfig
from slime_dsa.models.glm_moe_dsa import MLAttention, PackedBatch

# Replicated weights whose gradient each TP rank only sees its heads' share of.
PARTIAL_GRAD = ("q_a_proj.", "q_a_layernorm.", "kv_a_proj_with_mqa.", "kv_a_layernorm.")


class DSAAttention(nn.Module):
    """MLA with DSA over H / tp heads; x (T / tp, 1, D) sequence shards -> (T / tp, 1, D)."""

    def __init__(self, config: ModelConfig, megatron: TransformerConfig, layer_idx: int) -> None:
        super().__init__()
        self.tp = megatron.tensor_model_parallel_size
        local = dataclasses.replace(config, num_attention_heads=config.num_attention_heads // self.tp)
        self.core = MLAttention(local, layer_idx)  # q_b_proj / kv_b_proj hold this rank's heads
        self.core.o_proj = nn.Identity()  # the head outputs leave through the row-parallel projection below
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.v_head_dim, config.hidden_size, config=megatron,
            init_method=nn.init.zeros_, bias=config.attention_bias, input_is_parallel=True, skip_bias_add=False)
        for proj in (self.core.q_b_proj, self.core.kv_b_proj):  # this rank's heads' rows: a TP split, as megatron's
            set_tensor_model_parallel_attributes(proj.weight, is_parallel=True, dim=0, stride=1)
        if megatron.sequence_parallel:
            for name, p in self.core.named_parameters():
                if name.startswith(PARTIAL_GRAD):
                    p.sequence_parallel = True

    @property
    def layer_idx(self) -> int:
        return self.core.layer_idx

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: PackedBatch,
                shared_rows: torch.Tensor | None, replay_local: torch.Tensor | None = None, capture: bool = False,
                index_topk: int | None = None):
        """As MLAttention.forward, on sequence shards: (out (T / tp, 1, D), local top-k, key rows, capture record)."""
        if self.tp > 1:
            x = gather_from_sequence_parallel_region(x)  # (T, 1, D); backward reduce-scatters the partial grads
        heads, local, rows, record = self.core(x.squeeze(1), cos, sin, batch, shared_rows, replay_local, capture,
                                               index_topk)  # (T, H/tp * Dv)
        if self.tp == 1:  # torch's linear, forward and backward, as MLAttention's o_proj (bf16 rounds alike)
            out = F.linear(heads, self.o_proj.weight, self.o_proj.bias).unsqueeze(1)  # (T, 1, D)
        else:
            out, _ = self.o_proj(heads.unsqueeze(1))  # (T / tp, 1, D)
        if record is not None and self.tp > 1:
            record["q"], record["lse"] = gather_heads(record["q"]), gather_heads(record["lse"])
        return out, local, rows, record


def gather_heads(x: torch.Tensor) -> torch.Tensor:
    """(T, H / tp, ...) of every TP rank -> (T, H, ...), no gradient (the indexer loss's attention target)."""
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)
