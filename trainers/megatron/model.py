"""GLM-MoE-DSA from megatron-core pieces: vocab-parallel embedding and output layer, megatron's MLP (dense layers, gate
and up as two GEMMs at TP 1: mlp.py) and MoE layer (GlmMoeDsa's sigmoid top-k with the selection bias and
group-limited routing, shared expert), our DSA attention (attention.py) and RMSNorm. The routed experts are
megatron's SequentialMLP, with grouped GEMMs on a GPU (experts.py). The same packed-batch interface as
slime_dsa.models' causal LM, so the shared step (trainers/rank.py) trains it unchanged: token_logprobs_with_output
returns a ModelOutput with HF-shaped contents.

Layout: activations between layers are (T / tp, 1, D) sequence shards when tp > 1 (sequence parallelism, which
megatron requires for MoE under TP), else (T, 1, D); a packed batch is padded with one extra sequence to a multiple
of tp and trimmed back at the end. Shapes: T tokens, D hidden, V vocabulary, K = index_topk.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn
from torch.utils.checkpoint import checkpoint

from slime_dsa.models.config import ModelConfig
from slime_dsa.models.glm_moe_dsa import REPLAY_COMPUTE, ModelOutput, PackedBatch, RMSNorm
from slime_dsa.models.logprobs import chunked_token_logprobs
from slime_dsa.models.prefix_sharing import GatheredKeys
from slime_dsa.models.rope import rope_cos_sin, rope_inv_freq
from trainers.megatron.attention import DSAAttention
from trainers.megatron.experts import moe_spec
from trainers.megatron.logprobs import vocab_parallel_logprobs
from trainers.megatron.mlp import SplitGluMLP


KEY_ROWS = ("kv", "index_k")  # capture-record tensors over key rows; the others are over query rows


def _norm(config: ModelConfig, megatron: TransformerConfig) -> RMSNorm:
    """An RMSNorm over sequence shards: its gradient is partial per TP rank (megatron's sequence_parallel mark)."""
    norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
    norm.weight.sequence_parallel = megatron.sequence_parallel
    return norm


def _key_rows(input_ids: torch.Tensor, batch: PackedBatch) -> int:
    """The batch's key rows, from its layout where that holds them (no read of cu_seqlens_k from the device, which
    would wait for the GPU at the start of every forward): its query rows without a cache, the gathered rows with
    shared prompts."""
    if batch.kv_cache is None:
        return input_ids.shape[0]
    if isinstance(batch.kv_cache, GatheredKeys):
        return batch.kv_cache.key_rows.shape[0]
    return int(batch.cu_seqlens_k[-1])


class DecoderLayer(nn.Module):
    """Pre-norm residual block: DSA attention, then megatron's MLP (dense) or MoE layer (sparse)."""

    def __init__(self, config: ModelConfig, megatron: TransformerConfig, layer_idx: int,
                 groups: ProcessGroupCollection) -> None:
        super().__init__()
        self.input_layernorm = _norm(config, megatron)
        self.self_attention = DSAAttention(config, megatron, layer_idx)
        self.pre_mlp_layernorm = _norm(config, megatron)
        if config.mlp_layer_types[layer_idx] == "sparse":
            self.mlp = moe_spec(config.n_routed_experts)(config=megatron, layer_number=layer_idx + 1, pg_collection=groups)
            self.mlp.router.frozen_expert_bias = True  # e_score_correction_bias is loaded, never updated in training
        else:
            self.mlp = SplitGluMLP(megatron, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                           linear_fc2=RowParallelLinear), tp_group=groups.tp)

    def forward(self, h, cos, sin, batch, shared_rows, replay_local=None, capture=False, index_topk=None):
        attn, local, rows, record = self.self_attention(self.input_layernorm(h), cos, sin, batch, shared_rows,
                                                        replay_local, capture, index_topk)
        h = h + attn
        h = h + self.mlp(self.pre_mlp_layernorm(h))[0]
        return h, local, rows, record


class MegatronGlmMoeDsa(nn.Module):
    """The causal LM on one rank: its shards of every tensor-/expert-parallel weight, the rest whole."""

    def __init__(self, config: ModelConfig, megatron: TransformerConfig, groups: ProcessGroupCollection) -> None:
        super().__init__()
        if config.num_nextn_predict_layers or config.tie_word_embeddings:
            raise ValueError("trainer.backend megatron does not build MTP layers (num_nextn_predict_layers) or tied "
                             "embeddings (tie_word_embeddings) yet; use trainer.backend fsdp")
        self.config, self.megatron = config, megatron
        self.tp = megatron.tensor_model_parallel_size
        self.embedding = VocabParallelEmbedding(config.vocab_size, config.hidden_size, init_method=nn.init.zeros_,
                                                reduce_scatter_embeddings=megatron.sequence_parallel, config=megatron)
        self.layers = nn.ModuleList(DecoderLayer(config, megatron, i, groups) for i in range(config.num_hidden_layers))
        self.final_norm = _norm(config, megatron)
        self.output_layer = ColumnParallelLinear(config.hidden_size, config.vocab_size, config=megatron,
                                                 init_method=nn.init.zeros_, bias=False, gather_output=False)
        self.gradient_checkpointing = False  # activation recomputation, one decoder layer at a time
        self._inv_freq, self._rope_scaling = rope_inv_freq(config)

    # -- forward ------------------------------------------------------------------------------------

    def _pad(self, input_ids: torch.Tensor, batch: PackedBatch, replay_topk: torch.Tensor | None):
        """Append one padding sequence so that T is a multiple of tp (sequence shards of equal length) and, with
        expert parallelism, the longest of the expert-parallel group (megatron's token all-gather needs equal
        lengths)."""
        T = input_ids.shape[0]
        target = T + (-T) % self.tp
        if self.megatron.expert_model_parallel_size > 1:
            longest = torch.tensor([target], device=input_ids.device)
            dist.all_reduce(longest, op=dist.ReduceOp.MAX,
                            group=parallel_state.get_expert_tensor_and_model_parallel_group())
            target = int(longest)
        pad = target - T
        if not pad:
            return input_ids, batch, replay_topk
        dev = input_ids.device
        input_ids = torch.cat([input_ids, input_ids.new_zeros(pad)])
        keys = batch.kv_cache
        if isinstance(keys, GatheredKeys):  # shared-prompt packing: the padding sequence's keys are its own rows
            keys = GatheredKeys(torch.cat([keys.key_rows, torch.arange(T, target, device=dev)]))
        elif keys is not None:
            raise ValueError("a packed batch with a KV cache cannot be padded for tensor/expert parallelism")
        batch = PackedBatch(positions=torch.cat([batch.positions, torch.arange(pad, device=dev)]),
                            cu_seqlens_q=torch.cat([batch.cu_seqlens_q, batch.cu_seqlens_q[-1:] + pad]),
                            cu_seqlens_k=torch.cat([batch.cu_seqlens_k, batch.cu_seqlens_k[-1:] + pad]), kv_cache=keys)
        if replay_topk is not None:
            fill = replay_topk.new_full((replay_topk.shape[0], pad, replay_topk.shape[2]), REPLAY_COMPUTE)
            replay_topk = torch.cat([replay_topk, fill], dim=1)
        return input_ids, batch, replay_topk

    def forward_hidden(self, input_ids: torch.Tensor, batch: PackedBatch, *, replay_topk: torch.Tensor | None = None,
                       return_topk: bool = False, capture_dsa: bool = False, index_topk: int | None = None) -> ModelOutput:
        """Packed forward to the final hidden states (T, D), whole on every rank (see GlmMoeDsaForCausalLM)."""
        T, Tk = input_ids.shape[0], _key_rows(input_ids, batch)  # query rows, key rows (more with shared prompts)
        input_ids, batch, replay_topk = self._pad(input_ids, batch, replay_topk)
        h = self.embedding(input_ids[None])  # (T / tp, 1, D) reduce-scattered, or (1, T, D)
        if not self.megatron.sequence_parallel:
            h = h.transpose(0, 1)  # (T, 1, D)
        if self._inv_freq.device != h.device:
            self._inv_freq = self._inv_freq.to(h.device)
        cos, sin = rope_cos_sin(batch.positions, self._inv_freq, self._rope_scaling, h.dtype)
        full_ids = {layer: i for i, layer in enumerate(self.config.full_layer_ids)}
        selections, records, shared_rows = [], [], None
        for layer in self.layers:
            idx = layer.self_attention.layer_idx
            replay = replay_topk[full_ids[idx]] if replay_topk is not None and idx in full_ids else None
            if self.gradient_checkpointing and torch.is_grad_enabled() and not capture_dsa:
                h, local, shared_rows, record = checkpoint(layer, h, cos, sin, batch, shared_rows, replay, False,
                                                           index_topk, use_reentrant=False)
            else:
                h, local, shared_rows, record = layer(h, cos, sin, batch, shared_rows, replay, capture_dsa, index_topk)
            if record is not None:
                records.append({"layer": idx, **{k: v[: Tk if k in KEY_ROWS else T] if isinstance(v, torch.Tensor)
                                                 else v for k, v in record.items()}})
            if local is not None:
                selections.append(local[:T])
        h = self.final_norm(h)
        if self.megatron.sequence_parallel:
            h = gather_from_sequence_parallel_region(h)  # (T, 1, D); backward sums the vocabulary shards' grads
        return ModelOutput(logits=None, hidden_states=h.squeeze(1)[:T],
                           topk_indices=torch.stack(selections) if return_topk else None,
                           dsa_layers=records if capture_dsa else None)

    def _logprobs(self, hidden, targets, temperature, chunk_size, return_entropy):
        weight = self.output_layer.weight  # (V / tp, D)
        if self.tp == 1:
            return chunked_token_logprobs(hidden, weight, targets, temperature, chunk_size, return_entropy)
        return vocab_parallel_logprobs(hidden, weight, targets, temperature, chunk_size, return_entropy)

    def token_logprobs_with_output(self, input_ids: torch.Tensor, batch: PackedBatch, *, temperature: float = 1.0,
                                   chunk_size: int = 1024, return_entropy: bool = False, prefix_pack=None,
                                   candidate_ids: torch.Tensor | None = None,
                                   **forward_kwargs) -> tuple[torch.Tensor, torch.Tensor | None, ModelOutput]:
        """log p(x_t | x_<t) of every packed token (0 at each sequence's first), entropy, and the ModelOutput; as
        GlmMoeDsaForCausalLM.token_logprobs_with_output (prefix_pack: shared prompts computed once)."""
        if candidate_ids is not None:  # recipe check refuses algorithm.opd_topk with this backend
            raise ValueError("the megatron backend computes no log-probs at teacher candidates (algorithm.opd_topk)")
        if prefix_pack is not None:
            out = self.forward_hidden(prefix_pack.input_ids, prefix_pack.batch, **forward_kwargs)
            index = prefix_pack.response_index
            hidden = out.hidden_states.index_select(0, prefix_pack.response_rows)  # (R, D)
            logp_r, ent_r = self._logprobs(hidden, input_ids.index_select(0, index), temperature, chunk_size,
                                           return_entropy)
            logp = logp_r.new_zeros(input_ids.shape[0]).index_copy(0, index, logp_r)
            ent = None if ent_r is None else ent_r.new_zeros(input_ids.shape[0]).index_copy(0, index, ent_r)
            return logp, ent, out
        out = self.forward_hidden(input_ids, batch, **forward_kwargs)
        starts = batch.cu_seqlens_q[:-1]
        logp_next, ent_next = self._logprobs(out.hidden_states, torch.roll(input_ids, -1), temperature, chunk_size,
                                             return_entropy)  # row t predicts x_{t+1}
        logp = torch.roll(logp_next, 1)
        logp[starts] = 0.0
        ent = None
        if ent_next is not None:
            ent = torch.roll(ent_next, 1)
            ent[starts] = 0.0
        return logp, ent, out

    def token_logprobs(self, input_ids: torch.Tensor, batch: PackedBatch, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        logp, ent, _ = self.token_logprobs_with_output(input_ids, batch, **kwargs)
        return logp, ent
