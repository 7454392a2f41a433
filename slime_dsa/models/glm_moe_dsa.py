"""GLM-MoE-DSA (GLM-5) in plain PyTorch, numerically the same as transformers' GlmMoeDsaForCausalLM.

Design choices, top to bottom:
- MLA attention: low-rank q (q_a -> norm -> q_b) and a shared kv latent (kv_a -> norm) plus one rope key.
  Attention runs in absorbed "MQA mode": kv_b_proj is folded into the query and the output, so every head
  attends to the same (kv_lora_rank + rope) rows. That is what the KV cache stores and what kernels consume.
- RoPE is interleaved on the rope slice (DeepSeek layout), with yarn mscale where configured.
- DSA lightning indexer: ReLU scores from its own small q/k projections pick index_topk keys per query.
- IndexShare: `shared` layers reuse the top-k of the nearest preceding `full` layer.
- MoE: sigmoid router with e_score_correction_bias, group-limited top-k, a shared expert, routed scaling.
  The first `first_k_dense_replace` layers use a dense MLP.
- Optional MTP layers (DeepSeek-V3 style) stored as model.layers.{num_hidden_layers + i}.
Every forward is over *packed* sequences (tokens concatenated, cu_seqlens marks boundaries, no padding);
`forward(input_ids (B, T), attention_mask)` unpads, runs packed, and pads the logits back.
Shapes: T tokens in the pack, H heads, Dn/Dr/Dl/Dv nope/rope/latent/value dims, K = index_topk.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from slime_dsa import ops
from slime_dsa.devices import foreach_copy, upload
from slime_dsa.models import fused_pointwise
from slime_dsa.models.config import ModelConfig
from slime_dsa.models.logprobs import chunked_logprobs
from slime_dsa.models.rope import apply_interleaved_rope, rope_cos_sin, rope_inv_freq
from slime_dsa.ops import invariant

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)  # (M, K) x (G, K, N), offs (G,)
logger = logging.getLogger(__name__)
REPLAY_COMPUTE = -2  # a replay_topk row starting with this value is computed by the indexer, not replayed


# ----------------------------------------------------------------------------------------------
# The packed batch


class KVCache(Protocol):
    """What a decoding engine plugs in: per-layer storage of latent kv rows and indexer keys."""

    def update(
        self, layer_idx: int, kv: torch.Tensor, index_k: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Store this step's rows (Tq, D) / (Tq, Di); return the key rows attention reads (the batch's
        `to_rows` indexes them): every key of the batch in cu_seqlens_k layout, or a whole paged pool."""


@dataclass
class PackedBatch:
    """Where every token of a packed forward sits. Queries are the last rows of their sequence."""

    positions: torch.Tensor  # (Tq,) position of each query token in its sequence
    cu_seqlens_q: torch.Tensor  # (S+1,) query rows per sequence
    cu_seqlens_k: torch.Tensor  # (S+1,) key rows per sequence (== cu_seqlens_q without a cache)
    kv_cache: KVCache | None = None
    # The same offsets as host lists when the builder has them: the indexer then reads nothing back from the device.
    host_cu_seqlens: tuple[list[int], list[int]] | None = None

    def __post_init__(self) -> None:
        # Sequence of each query row, by search rather than repeat_interleave: no host sync on CUDA.
        rows = torch.arange(len(self.positions), device=self.cu_seqlens_q.device)
        seq_id = torch.searchsorted(self.cu_seqlens_q[1:], rows, right=True)
        # (Tq,) first key row of each query's sequence. Derived, so not a field: FSDP2's input cast (mixed
        # precision) rebuilds dataclass arguments with dataclasses.replace(**every field), which an init=False
        # field refuses; the rebuilt batch derives it again here.
        self.key_start = self.cu_seqlens_k[seq_id]

    @classmethod
    def from_seqlens(cls, seqlens: list[int] | torch.Tensor, device: torch.device | str = "cpu") -> "PackedBatch":
        """A batch of whole sequences (training / prefill without a cache)."""
        host_cu = list(itertools.accumulate(seqlens, initial=0)) if isinstance(seqlens, list) else None
        lens = upload(torch.as_tensor(seqlens, dtype=torch.long), device)
        cu = F.pad(lens.cumsum(0), (1, 0))
        total = int(cu[-1]) if host_cu is None else host_cu[-1]  # known on the host: no sync for the sizes
        positions = torch.arange(total, device=device) - torch.repeat_interleave(cu[:-1], lens, output_size=total)
        return cls(positions=positions, cu_seqlens_q=cu, cu_seqlens_k=cu,
                   host_cu_seqlens=None if host_cu is None else (host_cu, host_cu))

    @torch.compiler.disable
    def select_topk(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, scale: float) -> torch.Tensor:
        """The indexer's causal top-k of every query row: (Tq, topk) sequence-local key positions, -1 padded.
        Eager in a compiled layer (trainer.compile), as the op it calls: traced, it would pass host_cu_seqlens on and
        be recompiled for every number of sequences in a pack."""
        return ops.indexer_topk(q, k, weights, self.cu_seqlens_q, self.cu_seqlens_k, topk, scale,
                                host_cu_seqlens=self.host_cu_seqlens)

    def to_rows(self, local_indices: torch.Tensor) -> torch.Tensor:
        """Sequence-local key positions (Tq, K) -> rows of the key tensor attention reads, -1 kept."""
        return torch.where(local_indices >= 0, local_indices + self.key_start[:, None], local_indices)


@dataclass
class ModelOutput:
    """What a forward returns; fields are None unless asked for."""

    logits: torch.Tensor | None  # (B, T, V) for padded input, (T, V) for packed input
    hidden_states: torch.Tensor  # (T, D) after the final norm, packed
    topk_indices: torch.Tensor | None = None  # (n_full_layers, T, K) sequence-local positions, -1 padded
    dsa_layers: list[dict] | None = None  # per layer: what the indexer loss needs (see MLAttention.forward)
    mtp_hidden: list[torch.Tensor] | None = None  # per MTP layer (T, D), before the shared head
    candidate_logprobs: torch.Tensor | None = None  # (T, K) log p(candidate_ids[t, j] | x_<t), flat token rows


# ----------------------------------------------------------------------------------------------
# Building blocks


class Linear(nn.Linear):
    """nn.Linear that takes the batch-invariant GEMM when that mode is on (model.true_on_policy)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if invariant.is_enabled():
            return invariant.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def _fused(module: nn.Module) -> bool:
    """Whether `module` runs its pointwise chain compiled now: an engine's model (fused_pointwise.enable) in a decode
    step (fused_pointwise.fusing)."""
    return module.fused_pointwise and fused_pointwise.active()


class RMSNorm(nn.Module):
    fused_pointwise = False  # fused_pointwise.enable

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if invariant.is_enabled():
            return invariant.rms_norm(x, self.weight, self.eps)
        if _fused(self):
            return fused_pointwise.run(rms_norm, x, self.weight, eps=self.eps)
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Fused normalisation in float32, then transformers' rounding: cast to x's dtype before the weight."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class IndexerHead(Linear):
    """The indexer's per-head weights (weights_proj): computed in float32 whatever dtype the weight is held in, so
    that bf16 noise here does not change the top-k. Held in float32 in every path (float32_modules); a module call,
    not a read of .weight, so that a separate FSDP2 shard of it is gathered."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if invariant.is_enabled():
            return invariant.linear(x.float(), self.weight.float())
        return F.linear(x.float(), self.weight.float())


class Indexer(nn.Module):
    """DSA lightning indexer: I[t, s] = sum_j w[t, j] relu(q_j[t] . k[s] / sqrt(Di)), w = weights_proj(x) / sqrt(Hi)."""

    fused_pointwise = False  # fused_pointwise.enable

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = config.index_n_heads, config.index_head_dim, config.qk_rope_head_dim
        self.index_topk = config.index_topk
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = IndexerHead(config.hidden_size, self.n_heads, bias=False)
        self.softmax_scale = self.head_dim**-0.5

    def _rope_first(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if _fused(self):
            return fused_pointwise.run(rope_first, x, cos, sin, rope_dim=self.rope_dim)
        return rope_first(x, cos, sin, self.rope_dim)

    def project(
        self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Index queries (T, Hi, Di), keys (T, Di) and head weights (T, Hi) float32."""
        T = x.shape[0]
        q = self._rope_first(self.wq_b(q_latent).view(T, self.n_heads, self.head_dim), cos, sin)  # (T, Hi, Di)
        k = self._rope_first(self.k_norm(self.wk(x)), cos, sin)  # (T, Di)
        w = self.weights_proj(x) * self.n_heads**-0.5  # (T, Hi) float32
        return q, k, w


def rope_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """The indexer's rotation: unlike MLA, it puts its rope slice first."""
    x_rot, x_pass = x.split([rope_dim, x.shape[-1] - rope_dim], dim=-1)
    return torch.cat([apply_interleaved_rope(x_rot, cos, sin), x_pass], dim=-1)


class MLAttention(nn.Module):
    """Multi-head latent attention with DSA sparse selection, computed in absorbed MQA mode."""

    fused_pointwise = False  # fused_pointwise.enable

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.n_heads = c.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim, self.kv_rank = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        self.index_topk = c.index_topk
        self.scale = c.attention_scale()
        self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank)
        self.q_b_proj = Linear(c.q_lora_rank, self.n_heads * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank)
        self.kv_b_proj = Linear(c.kv_lora_rank, self.n_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = Linear(self.n_heads * c.v_head_dim, c.hidden_size, bias=c.attention_bias)
        is_full = layer_idx >= c.num_hidden_layers or c.indexer_types[layer_idx] == "full"  # MTP layers index for themselves
        self.indexer = Indexer(c) if is_full else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: PackedBatch,
        shared_rows: torch.Tensor | None,
        replay_local: torch.Tensor | None = None,
        capture: bool = False,
        index_topk: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, dict | None]:
        """x (T, D) -> (out (T, D), this layer's local top-k or None if shared, key rows used (T, K), capture record).

        With capture, the record holds what the indexer loss needs but the layer's index, which the caller adds
        (read here it would be a constant of a compiled layer's graph, recompiled for every layer: trainer.compile).
        Returned, not appended to a caller's list: FSDP's forward hooks may copy containers passed in.

        replay_local rows whose first entry is REPLAY_COMPUTE are selected by the indexer; index_topk overrides
        config.index_topk for this call (>= the sequence length = dense attention).
        """
        T, H = x.shape[0], self.n_heads
        q_latent = self.q_a_layernorm(self.q_a_proj(x))  # (T, Q)
        q = self.q_b_proj(q_latent).view(T, H, self.nope_dim + self.rope_dim)  # (T, H, Dn+Dr)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope_dim], dim=-1)  # (T, Dl), (T, Dr)
        c_kv = self.kv_a_layernorm(c_kv)
        if _fused(self):
            q_rope = fused_pointwise.run(apply_interleaved_rope, q_rope, cos, sin)  # (T, H, Dr)
            k_rope = fused_pointwise.run(apply_interleaved_rope, k_rope, cos, sin)  # (T, Dr)
        else:
            q_rope = apply_interleaved_rope(q_rope, cos, sin)
            k_rope = apply_interleaved_rope(k_rope, cos, sin)

        w_kv = self.kv_b_proj.weight.view(H, self.nope_dim + self.v_dim, self.kv_rank)
        w_uk, w_uv = w_kv[:, : self.nope_dim], w_kv[:, self.nope_dim :]  # (H, Dn, Dl), (H, Dv, Dl)
        if invariant.is_enabled():
            q_absorbed = invariant.head_matmul(q_nope, w_uk)  # (T, H, Dl)
        else:
            q_absorbed = torch.einsum("thn,hnl->thl", q_nope, w_uk)
        q_mqa = torch.cat([q_absorbed, q_rope], dim=-1)  # (T, H, Dl+Dr)
        kv_new = torch.cat([c_kv, k_rope], dim=-1)  # (T, Dl+Dr)

        index_q = index_k_new = index_w = None
        if self.indexer is not None:
            # Detached inputs: the selection is discrete, so the only gradient an indexer gets is the indexer loss,
            # and that loss must not reach the layers below (docs/algorithms.md section 6, sparse stage).
            index_q, index_k_new, index_w = self.indexer.project(x.detach(), q_latent.detach(), cos, sin)
        if batch.kv_cache is not None:
            kv, index_k = batch.kv_cache.update(self.layer_idx, kv_new, index_k_new)
        else:
            kv, index_k = kv_new, index_k_new

        local = None
        if self.indexer is not None:
            compute = None if replay_local is None else replay_local[:, 0] == REPLAY_COMPUTE  # (T,)
            if compute is None or bool(compute.any()):
                local = batch.select_topk(
                    index_q.detach(), index_k.detach(), index_w.detach(), index_topk or self.index_topk,
                    self.indexer.softmax_scale,
                )  # (T, K)
            if replay_local is not None:
                local = replay_local if local is None else torch.where(compute[:, None], local, replay_local)
            rows = batch.to_rows(local)
        else:
            if shared_rows is None:
                raise ValueError(f"layer {self.layer_idx} is 'shared' but no preceding 'full' layer selected keys")
            rows = shared_rows

        packed = batch.cu_seqlens_k if batch.kv_cache is None else None  # kv rows are this call's rows
        out_latent, lse = ops.sparse_mla_attention(q_mqa, kv, rows, self.scale, self.kv_rank, packed)  # (T, H, Dl), (T, H)
        record = None
        if capture:
            record = {
                "q": q_mqa.detach(), "kv": kv.detach(), "lse": lse.detach(),
                "scale": self.scale, "rows": rows, "index_q": index_q, "index_k": index_k, "index_weights": index_w,
                "index_scale": self.indexer.softmax_scale if self.indexer is not None else None,
            }
        if invariant.is_enabled():
            out = invariant.head_matmul(out_latent, w_uv.transpose(1, 2))  # (T, H, Dv)
        else:
            out = torch.einsum("thl,hvl->thv", out_latent, w_uv)  # (T, H, Dv)
        return self.o_proj(out.reshape(T, H * self.v_dim)), local, rows, record


class MLP(nn.Module):
    fused_pointwise = False  # fused_pointwise.enable

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.gate_proj = Linear(config.hidden_size, inter, bias=False)
        self.up_proj = Linear(config.hidden_size, inter, bias=False)
        self.down_proj = Linear(inter, config.hidden_size, bias=False)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused(self):
            return fused_pointwise.run(gated_mlp, x, self.gate_proj.weight, self.up_proj.weight,
                                       self.down_proj.weight, act=self.act)
        return gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, self.act)


def gated_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act) -> torch.Tensor:
    """down(act(gate(x)) * up(x)) with the weights given, as MLP.forward and Linear compute it."""
    linear = invariant.linear if invariant.is_enabled() else F.linear
    h = linear(x, gate, None)
    h = invariant.rowwise(act, h) if invariant.is_enabled() else act(h)
    return linear(h * linear(x, up, None), down, None)


class Router(nn.Module):
    """Sigmoid router with a load-balancing bias (selection only) and group-limited top-k. Runs in float32."""

    fused_pointwise = False  # fused_pointwise.enable

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.n_experts = config.num_experts_per_tok, config.n_routed_experts
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.n_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, D) -> routing weights (T, k) float32, expert ids (T, k) ascending."""
        settings = dict(top_k=self.top_k, n_group=self.n_group, topk_group=self.topk_group,
                        norm_topk_prob=self.norm_topk_prob, routed_scaling_factor=self.routed_scaling_factor)
        if invariant.is_enabled():
            scores = invariant.rowwise(torch.sigmoid, invariant.linear(x.float(), self.weight.float()))  # (T, E)
            return route(scores, self.e_score_correction_bias, **settings)
        if _fused(self):
            return fused_pointwise.run(score_and_route, x, self.weight, self.e_score_correction_bias, **settings)
        return score_and_route(x, self.weight, self.e_score_correction_bias, **settings)


def score_and_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                    **settings) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's float32 sigmoid scores of x (T, D), then `route`."""
    return route(F.linear(x.float(), weight.float()).sigmoid(), bias, **settings)


def route(scores: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
          routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid scores (T, E) float32 -> routing weights (T, k) float32, expert ids (T, k): the top-k of scores + bias
    (within the top topk_group groups), weighted by their scores. Each token's ids are in ascending order, the order
    every path normalises and sums a token's experts in (the experts' loop and grouped GEMMs, Megatron's MoE layer):
    float32 sums in another order round differently, and in bf16 one such difference can flip later expert choices."""
    choice = scores + bias
    if topk_group < n_group:  # group-limited routing; with every group kept it changes nothing
        grouped = choice.view(-1, n_group, scores.shape[-1] // n_group)  # (T, G, E/G)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (T, G)
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()  # (T, G)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(-1, scores.shape[-1])
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    expert_ids = choice.topk(top_k, dim=-1, sorted=False).indices.sort(dim=-1).values  # (T, k)
    weights = scores.gather(1, expert_ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, expert_ids


def _compute_dtype(x: torch.Tensor, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype matmuls run in: autocast's where it is on for x's device, else the weights'."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else weight_dtype


class Experts(nn.ModuleList):
    """Routed experts, one MLP each: stored as experts.{i}.gate_proj/up_proj/down_proj, as HF checkpoints are.

    Two paths, same math: a loop over experts (the reference), and a grouped GEMM over stacked expert weights,
    which needs no host sync (the loop reads the per-expert counts on the host) and a handful of ops instead of a
    few per expert. The grouped path runs on CUDA in bf16 and on CPU in float32, the loop elsewhere. Inference mode
    (the engine) keeps a stacked copy, rebuilt when any expert weight changes (version counters, storage) and
    dropped by `drop_stacked()`; other passes (the trainer) stack per forward, so gradients flow to every expert.
    A trainer's compute copy can hold the weights as two stacked leaves instead (`stack_as_leaves`).
    """

    use_grouped_mm: bool | None = None  # None: on CUDA in bf16 and on CPU in float32; True / False force it
    _grouped_failed = False  # set when the automatic choice failed once on this process' device
    leaves: tuple[torch.Tensor, torch.Tensor] | None = None  # (w_gate_up, w_down) when the weights are their views

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(MLP(config, config.moe_intermediate_size) for _ in range(config.n_routed_experts))
        self._stacked: tuple[tuple, torch.Tensor, torch.Tensor] | None = None  # (fingerprint, w_gate_up, w_down)
        self._refill_views: list[torch.Tensor] | None = None  # views of _stacked's buffers, one per expert weight

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """x (T, D), weights/expert_ids (T, k) -> (T, D)."""
        if invariant.is_enabled():  # every expert's rows through an invariant GEMM, summed in expert order
            grouped = invariant.grouped_linear_kernel(x)
            if grouped is not None:
                return self._forward_invariant_grouped(x, weights, expert_ids, grouped)
            return self._forward_loop(x, weights, expert_ids)
        if self._grouped_ok(x):
            if torch.compiler.is_compiling():  # a traced failure must not switch the process to the loop
                if _compute_dtype(x, self[0].gate_proj.weight.dtype) in _GROUPED_MM_TRACED_DTYPES:
                    return self._forward_grouped(x, weights, expert_ids)
                return _grouped_eagerly(self, x, weights, expert_ids)
            if self.use_grouped_mm:
                return self._forward_grouped(x, weights, expert_ids)
            try:
                return self._forward_grouped(x, weights, expert_ids)
            except torch.OutOfMemoryError:  # the device, not the kernel: the loop would not fit either
                raise
            except (RuntimeError, NotImplementedError) as err:  # e.g. no grouped GEMM kernel for this GPU
                logger.warning("experts: grouped_mm failed (%s: %s); using the per-expert loop", type(err).__name__, err)
                Experts._grouped_failed = True
                self.drop_stacked()
        loop = _loop_eagerly if torch.compiler.is_compiling() else Experts._forward_loop  # its counts are data
        return loop(self, x, weights, expert_ids)

    def _grouped_ok(self, x: torch.Tensor) -> bool:
        if _grouped_mm is None:
            return False
        if self.use_grouped_mm is not None:
            return self.use_grouped_mm
        dtype = _compute_dtype(x, self[0].gate_proj.weight.dtype)
        if Experts._grouped_failed or (x.dtype != dtype and not torch.is_autocast_enabled(x.device.type)):
            return False
        # grouped_mm wants every matrix row to start on a 16-byte boundary.
        hidden, inner = self[0].gate_proj.weight.shape[1], self[0].gate_proj.weight.shape[0]
        if (hidden * dtype.itemsize) % 16 or (inner * dtype.itemsize) % 16:
            return False
        return (x.is_cuda and dtype == torch.bfloat16) or (x.device.type == "cpu" and dtype == torch.float32)

    def graph_safe(self) -> bool:
        """Whether an inference forward on the experts' own device and dtype waits on no host (the grouped path):
        only then can it be captured in a CUDA graph. The loop reads the per-expert counts on the host. In
        batch-invariant mode, whether that mode's kernels (grouped experts, attention, indexer) serve the device."""
        if invariant.is_enabled():
            return invariant.graph_safe(self[0].gate_proj.weight)
        if _grouped_mm is None:
            return False
        if self.use_grouped_mm is not None:
            return self.use_grouped_mm
        weight = self[0].gate_proj.weight
        return not Experts._grouped_failed and weight.is_cuda and weight.dtype == torch.bfloat16

    def _forward_loop(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Tokens grouped by expert, one matmul per expert hit (one host sync for the counts)."""
        out = torch.zeros_like(x, dtype=torch.float32)  # the k weighted outputs summed in float32, as the grouped path
        top_k = expert_ids.shape[1]
        flat = expert_ids.reshape(-1)  # (T*k,)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self)).tolist()
        start = 0
        experts = self._expert_weights()
        for expert, count in enumerate(counts):
            if count == 0 and not torch.is_grad_enabled():
                continue  # under autograd every expert runs (maybe on 0 rows) so every rank has a grad for it (FSDP)
            slots = order[start : start + count]
            start += count
            tokens, k = slots // top_k, slots % top_k
            y = gated_mlp(x[tokens], *experts[expert], self[0].act) * weights[tokens, k, None]
            out.index_add_(0, tokens, y.float())
        return out.to(x.dtype)

    def _forward_grouped(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Grouped GEMMs over the (token, slot) rows sorted by expert; group offsets stay on the device."""
        T, top_k = expert_ids.shape
        # Inference reuses one stacked copy; autograd (and a trainer's no-grad pass) stacks the live weights.
        # (torch.compile never traces an inference-mode pass, and cannot ask: checked only outside it)
        inference = not torch.compiler.is_compiling() and torch.is_inference_mode_enabled()
        w_gate_up, w_down = self.stacked() if inference else self._stack()
        dtype = _compute_dtype(x, w_gate_up.dtype)  # under autocast (SFT: float32 weights), its dtype
        w_gate_up, w_down = w_gate_up.to(dtype), w_down.to(dtype)
        flat = expert_ids.reshape(-1)  # (T*k,)
        # Radix sort passes scale with the key width: expert ids fit in 8 or 16 bits.
        narrow = torch.uint8 if len(self) <= 256 else torch.int16 if len(self) <= 32768 else flat.dtype
        sorted_ids, order = torch.sort(flat.to(narrow), stable=True)  # (T*k,) slots sorted by expert
        # End row of each expert's group; bincount would sync on CUDA (it reads the max id on the host).
        experts = torch.arange(len(self), device=flat.device, dtype=sorted_ids.dtype)
        offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)  # (E,)
        xs = x[order // top_k].to(dtype)  # (T*k, D)
        gate, up = _grouped_mm(xs, w_gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)  # (T*k, I) each
        y = _grouped_mm(self[0].act(gate) * up, w_down.transpose(1, 2), offs=offs)  # (T*k, D)
        y = y * weights.reshape(-1)[order, None]  # float32, as the loop's
        # Back to (token, slot) order (order is a permutation: no atomics), summed over the k slots in float32.
        unsorted = torch.empty_like(y).index_copy_(0, order, y)
        return unsorted.view(T, top_k, -1).sum(1).to(x.dtype)

    def _forward_invariant_grouped(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                                   grouped_linear) -> torch.Tensor:
        """Batch-invariant mode with a grouped kernel (triton_invariant.grouped_linear): the grouped path's layout,
        and each token's k outputs summed in ascending expert order in float32, as the loop sums them."""
        T, top_k = expert_ids.shape
        expert_ids, slot = expert_ids.sort(dim=1)  # (T, k) each token's experts ascending
        weights = weights.gather(1, slot)
        w_gate_up, w_down = self.stacked() if torch.is_inference_mode_enabled() else self._stack()
        flat = expert_ids.reshape(-1)
        narrow = torch.uint8 if len(self) <= 256 else torch.int16 if len(self) <= 32768 else flat.dtype
        sorted_ids, order = torch.sort(flat.to(narrow), stable=True)  # (T*k,) slots sorted by expert
        experts = torch.arange(len(self), device=flat.device, dtype=sorted_ids.dtype)
        offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)  # (E,) end rows
        gate, up = grouped_linear(x[order // top_k], w_gate_up, offs).chunk(2, dim=-1)  # (T*k, I) each
        y = grouped_linear(invariant.rowwise(self[0].act, gate) * up, w_down, offs)  # (T*k, D)
        y = y.float() * weights.reshape(-1)[order, None]
        per_slot = torch.empty_like(y).index_copy_(0, order, y).view(T, top_k, -1)
        out = per_slot[:, 0]
        for k in range(1, top_k):  # one add per slot: a reduction kernel's order could depend on T
            out = out + per_slot[:, k]
        return out.to(x.dtype)

    def _fingerprint(self) -> tuple:
        params = [p for mlp in self for p in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)]
        first = params[0]
        return (first.device, first.dtype, first.data_ptr(), tuple(p._version for p in params))

    @torch.no_grad()
    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_gate_up (E, 2I, D), w_down (E, D, I)): stacked copies of the expert weights, rebuilt when they change."""
        if self.leaves is not None:
            return self._held_leaves()
        refill = self.stale_refill()
        if refill is not None:
            with torch.inference_mode(False), torch.no_grad():  # leaving inference mode re-enables grad
                foreach_copy(*refill)
        return self._stacked[1], self._stacked[2]

    @torch.no_grad()
    def stale_refill(self) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """None when the stacked copy is current; else (destinations, sources) whose copy brings it up to date in
        place, and it is marked current: the caller copies them before the next forward. A copy of another device
        or dtype (or none) is rebuilt here, and None returned.

        In place because captured CUDA graphs hold these very buffers; as one foreach copy (over every MoE layer
        in GlmMoeDsaPreTrainedModel.refresh_inference_caches) instead of a cat per expert and two stacks per layer.
        """
        key = self._fingerprint()
        old = self._stacked
        if old is not None and old[0] == key:
            return None
        with torch.inference_mode(False), torch.no_grad():  # leaving inference mode re-enables grad
            if old is None or old[0][:2] != key[:2]:
                self._stacked = self._refill_views = None  # free the stale copy before building the new one
                self._stacked = (key, *self._stack())
                return None
            if self._refill_views is None:
                experts = len(self)
                gate_up = old[1].view(2 * experts, -1, old[1].shape[-1]).unbind(0)  # gate_0, up_0, gate_1, ...
                self._refill_views = [*gate_up, *old[2].unbind(0)]
        self._stacked = (key, old[1], old[2])
        gate_up = [proj.weight for mlp in self for proj in (mlp.gate_proj, mlp.up_proj)]
        return self._refill_views, [*gate_up, *(mlp.down_proj.weight for mlp in self)]

    def stack_as_leaves(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Hold the expert weights as views of two stacked leaf tensors, w_gate_up (E, 2I, D) and w_down (E, D, I),
        which every forward uses and backward gives the gradients to; the per-expert parameters stop requiring grad.

        For a trainer's compute copy (trainers/fsdp/bf16_compute.py): a backward then ends in two gradient
        accumulations per layer instead of three per expert, and a forward stacks nothing. The leaves are plain
        attributes, not registered parameters, so `parameters()` and the state dict are unchanged."""
        with torch.no_grad():
            gate_up, down = (stacked.detach().clone() for stacked in self._stack())
        requires_grad = {p.requires_grad for mlp in self for p in mlp.parameters()}
        if len(requires_grad) != 1:
            raise ValueError("stack_as_leaves: the experts of one layer must all train or all be frozen")
        for mlp, views in zip(self, self._split(gate_up, down)):
            for proj, view in zip((mlp.gate_proj, mlp.up_proj, mlp.down_proj), views):
                proj.weight.data = view
                proj.weight.requires_grad_(False)
        self.leaves = (gate_up.requires_grad_(requires_grad.pop()), down.requires_grad_(gate_up.requires_grad))
        self.drop_stacked()
        return self.leaves

    def _held_leaves(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The leaves, once checked to still hold the expert weights: a module moved (.to) or given new weight
        tensors since stack_as_leaves would otherwise compute with the old values and train nothing it holds."""
        gate_up, down = self.leaves
        if torch.compiler.is_compiling():  # dynamo cannot read data_ptr: eager passes check, compiled ones cannot
            return gate_up, down
        if (self[0].gate_proj.weight.data_ptr() != gate_up.data_ptr()
                or self[0].down_proj.weight.data_ptr() != down.data_ptr()):
            raise RuntimeError("Experts: the expert weights are no longer views of the stacked leaves (the module was "
                               "moved or its weights replaced after stack_as_leaves)")
        return gate_up, down

    def _expert_weights(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(gate, up, down) of each expert; views of the leaves where there are leaves (one unbind node each)."""
        if self.leaves is None:
            return [(m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight) for m in self]
        return self._split(*self._held_leaves())

    def _split(self, gate_up: torch.Tensor, down: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Each expert's (gate, up, down) as views of stacked (E, 2I, D) and (E, D, I) weights."""
        gate_ups = gate_up.view(2 * len(self), -1, gate_up.shape[-1]).unbind(0)  # gate_0, up_0, gate_1, ...
        return [(gate_ups[2 * i], gate_ups[2 * i + 1], w_down) for i, w_down in enumerate(down.unbind(0))]

    def _stack(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.leaves is not None:
            return self._held_leaves()
        # One stack of gate_0, up_0, gate_1, ... viewed as (E, 2I, D) is each expert's [gate; up]: a cat per expert
        # before the stack cost a kernel and an autograd node per expert, twice the copying
        gate_up = torch.stack([proj.weight for mlp in self for proj in (mlp.gate_proj, mlp.up_proj)])
        return gate_up.view(len(self), -1, gate_up.shape[-1]), torch.stack([m.down_proj.weight for m in self])

    def drop_stacked(self) -> None:
        """Free the stacked copy (it is rebuilt on the next grouped forward)."""
        self._stacked = self._refill_views = None


# The dtypes torch.compile traces grouped_mm in: its fake-tensor kernel takes bf16 and fp16 only (torch 2.14), so in
# float32 (CPU) a compiled layer runs the grouped experts eagerly, with a graph break on either side.
_GROUPED_MM_TRACED_DTYPES = (torch.bfloat16, torch.float16)
_grouped_eagerly = torch.compiler.disable(Experts._forward_grouped)
# The loop reads per-expert counts on the host: traced, each new set of counts would recompile it.
_loop_eagerly = torch.compiler.disable(Experts._forward_loop)


class MoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.experts = Experts(config)
        self.gate = Router(config)
        self.shared_experts = MLP(config, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(x)
        return self.experts(x, weights, expert_ids) + self.shared_experts(x)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MLAttention(config, layer_idx)
        is_moe = layer_idx >= config.num_hidden_layers or config.mlp_layer_types[layer_idx] == "sparse"
        self.mlp = MoE(config) if is_moe else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, cos, sin, batch, shared_rows, replay_local=None, capture=False, index_topk=None):
        attn, local, rows, record = self.self_attn(
            self.input_layernorm(h), cos, sin, batch, shared_rows, replay_local, capture, index_topk
        )
        h = h + attn
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, local, rows, record


class MTPLayer(DecoderLayer):
    """Multi-token prediction (DeepSeek-V3): predicts token t+2 from h_t and the embedding of token t+1."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# ----------------------------------------------------------------------------------------------
# The model


class GlmMoeDsaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        n = config.num_hidden_layers
        layers = [DecoderLayer(config, i) for i in range(n)]
        layers += [MTPLayer(config, n + i) for i in range(config.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def float32_modules(model: nn.Module) -> list[nn.Module]:
    """The modules held in float32 at every compute dtype, values unrounded: the routers (weight and selection bias;
    transformers' _keep_in_fp32_modules_strict) and the indexer heads (its _keep_in_fp32_modules, which it applies
    to float16 only). In bf16 a rounding of these flips expert and key choices, so the engine and every trainer path
    hold them alike."""
    found = []
    for module in model.modules():
        if isinstance(module, Router):
            found.append(module)
        elif isinstance(module, Indexer):
            found.append(module.weights_proj)
    return found


@torch.no_grad()
def cast_keeping_float32(model: nn.Module, dtype: torch.dtype, keep: list[nn.Module]) -> None:
    """Floating-point parameters and buffers of `model` to dtype, those of `keep` (and their submodules) to float32:
    each converted once from the value it holds, so a kept float32 value is never rounded through dtype."""
    kept = {id(m) for module in keep for m in module.modules()}
    for module in model.modules():
        target = torch.float32 if id(module) in kept else dtype
        for p in module.parameters(recurse=False):
            if p.is_floating_point() and p.dtype != target:
                p.data = p.data.to(target)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point() and buffer.dtype != target:
                setattr(module, name, buffer.to(target))


class GlmMoeDsaPreTrainedModel(nn.Module):
    """What every model on the GLM-MoE-DSA backbone shares: the backbone at `model.`, RoPE, the packed forward to
    the final hidden states, initialisation and casting. A head on top makes the causal LM or the value model."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = GlmMoeDsaModel(config)
        self.gradient_checkpointing = False
        self._inv_freq, self._rope_scaling = rope_inv_freq(config)
        self._experts: list[Experts] | None = None  # experts_modules

    def forward_hidden(
        self,
        input_ids: torch.Tensor,
        batch: PackedBatch,
        *,
        replay_topk: torch.Tensor | None = None,
        return_topk: bool = False,
        capture_dsa: bool = False,
        return_mtp: bool = False,
        index_topk: int | None = None,
    ) -> ModelOutput:
        """Packed forward to the final hidden states: input_ids (T,) -> ModelOutput without logits.

        replay_topk (n_full_layers, T, K) replays a selection; its rows that start with REPLAY_COMPUTE are
        selected by the indexer as usual (partial replay). index_topk overrides config.index_topk for this call.
        """
        h = self.model.embed_tokens(input_ids)  # (T, D)
        if self._inv_freq.device != h.device:  # kept on the device: a host copy per forward would sync
            with torch.inference_mode(False):  # a normal tensor, usable by later autograd forwards too
                self._inv_freq = self._inv_freq.to(h.device)
        cos, sin = rope_cos_sin(batch.positions, self._inv_freq, self._rope_scaling, h.dtype)
        capture = [] if capture_dsa else None
        record = None
        full_ids = {layer: i for i, layer in enumerate(self.config.full_layer_ids)}
        selections, shared_rows = [], None
        for layer in self.model.layers[: self.config.num_hidden_layers]:
            idx = layer.self_attn.layer_idx
            replay = replay_topk[full_ids[idx]] if replay_topk is not None and idx in full_ids else None
            if self.gradient_checkpointing and torch.is_grad_enabled() and capture is None:  # recompute would capture twice
                h, local, shared_rows, _ = checkpoint(
                    layer, h, cos, sin, batch, shared_rows, replay, False, index_topk, use_reentrant=False
                )
            else:
                h, local, shared_rows, record = layer(h, cos, sin, batch, shared_rows, replay, capture_dsa, index_topk)
            if record is not None:
                capture.append({**record, "layer": idx})
            if local is not None:
                selections.append(local)
        mtp_hidden = self._mtp_forward(h, input_ids, cos, sin, batch) if return_mtp else None
        h = self.model.norm(h)
        return ModelOutput(
            logits=None,
            hidden_states=h,
            topk_indices=torch.stack(selections) if return_topk else None,
            dsa_layers=capture,
            mtp_hidden=mtp_hidden,
        )

    def _mtp_forward(self, h, input_ids, cos, sin, batch) -> list[torch.Tensor]:
        """Each MTP layer combines h_t with the embedding of token t+1 (0 past a sequence's end)."""
        outs = []
        next_ids = torch.roll(input_ids, -1)
        last = batch.cu_seqlens_q[1:] - 1
        for layer in self.model.layers[self.config.num_hidden_layers :]:
            emb = self.model.embed_tokens(next_ids)
            emb[last] = 0
            x = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(h)], dim=-1))
            h, _, _, _ = layer(x, cos, sin, batch, None)
            outs.append(layer.shared_head.norm(h))
        return outs

    # -- weights -------------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self) -> None:
        """Random initialisation, in one place: normal(0, initializer_range) matrices, unit norms, zero biases."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, (RMSNorm, nn.LayerNorm)):
                module.weight.fill_(1.0)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, Router):
                module.weight.normal_(0.0, std)
                module.e_score_correction_bias.zero_()

    def graph_safe(self) -> bool:
        """Whether an inference forward waits on no host, so that it can be captured in a CUDA graph: every MoE
        layer's experts take the grouped path (on CUDA in bfloat16), not the loop that reads counts on the host."""
        return all(module.graph_safe() for module in self.experts_modules())

    def experts_modules(self) -> list[Experts]:
        """Every MoE layer's Experts, found once: walking the modules after each weight update cost ~1 ms."""
        if self._experts is None:
            self._experts = [module for module in self.modules() if isinstance(module, Experts)]
        return self._experts

    @torch.no_grad()
    def refresh_inference_caches(self) -> None:
        """Bring the derived weight copies up to date now, in place where they exist (after a weight update): the
        experts' stacked copies of every MoE layer in one foreach copy."""
        destinations, sources = [], []
        for module in self.experts_modules():
            if module._stacked is not None:
                refill = module.stale_refill()
                if refill is not None:
                    destinations += refill[0]
                    sources += refill[1]
        if destinations:
            with torch.inference_mode(False), torch.no_grad():  # leaving inference mode re-enables grad
                foreach_copy(destinations, sources)

    def drop_inference_caches(self) -> None:
        """Free the derived copies of weights kept for fast inference (the experts' stacked weights)."""
        for module in self.experts_modules():
            module.drop_stacked()

    def cast(self, dtype: torch.dtype) -> "GlmMoeDsaPreTrainedModel":
        """Cast to dtype, but for float32_modules, held in float32 with their values as loaded (never rounded)."""
        cast_keeping_float32(self, dtype, float32_modules(self))
        return self

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype


class GlmMoeDsaForCausalLM(GlmMoeDsaPreTrainedModel):
    """Causal LM over packed sequences. Parameter names equal transformers' GlmMoeDsaForCausalLM."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # -- forwards ------------------------------------------------------------------------------

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs
    ) -> ModelOutput:
        """input_ids (B, T) with an optional 0/1 attention_mask (any padding side), or packed (T,) with `batch=`."""
        if input_ids.dim() == 1:
            return self.forward_packed(input_ids, kwargs.pop("batch", None) or PackedBatch.from_seqlens([len(input_ids)], input_ids.device), **kwargs)
        B, T = input_ids.shape
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        batch = PackedBatch.from_seqlens(mask.sum(1), input_ids.device)
        out = self.forward_packed(input_ids[mask], batch, **kwargs)
        if out.logits is not None:
            padded = out.logits.new_zeros(B, T, out.logits.shape[-1])
            padded[mask] = out.logits
            out.logits = padded
        return out

    def forward_packed(
        self,
        input_ids: torch.Tensor,
        batch: PackedBatch,
        *,
        replay_topk: torch.Tensor | None = None,
        return_logits: bool = True,
        return_topk: bool = False,
        capture_dsa: bool = False,
        return_mtp: bool = False,
        index_topk: int | None = None,
    ) -> ModelOutput:
        """Packed forward: input_ids (T,) -> ModelOutput, with logits (T, V) when return_logits (see forward_hidden)."""
        out = self.forward_hidden(input_ids, batch, replay_topk=replay_topk, return_topk=return_topk,
                                  capture_dsa=capture_dsa, return_mtp=return_mtp, index_topk=index_topk)
        if return_logits:
            out.logits = self.lm_head(out.hidden_states)
        return out

    def token_logprobs(
        self,
        input_ids: torch.Tensor,
        batch: PackedBatch,
        *,
        temperature: float = 1.0,
        chunk_size: int = 1024,
        return_entropy: bool = False,
        prefix_pack=None,
        **forward_kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log p(x_t | x_<t) for every packed token (0 at each sequence's first token), chunked over the vocab head.

        Returns (logprobs (T,), entropy (T,) or None); entropy at row t is that of the distribution over x_t.
        prefix_pack (a models.prefix_sharing.SharedPrefixPack of this flat pack) runs the forward with each shared
        prompt computed once; response tokens get the same results, in the flat layout, prompt tokens 0.
        """
        logp, ent, _ = self._token_logprobs(input_ids, batch, temperature, chunk_size, return_entropy, forward_kwargs,
                                            prefix_pack)
        return logp, ent

    def token_logprobs_with_output(
        self,
        input_ids: torch.Tensor,
        batch: PackedBatch,
        *,
        temperature: float = 1.0,
        chunk_size: int = 1024,
        return_entropy: bool = False,
        prefix_pack=None,
        candidate_ids: torch.Tensor | None = None,
        **forward_kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None, ModelOutput]:
        """`token_logprobs` plus the forward's ModelOutput (top-k, captured DSA tensors) for the trainer.

        With prefix_pack the ModelOutput is over the pack's rows, not the flat tokens. candidate_ids (T, K): also
        the log-probs of K given ids at each token row t (in the distribution over x_t), as out.candidate_logprobs
        (T, K); with prefix_pack only response rows get them (prompt rows 0).
        """
        return self._token_logprobs(input_ids, batch, temperature, chunk_size, return_entropy, forward_kwargs,
                                    prefix_pack, candidate_ids)

    def _token_logprobs(self, input_ids, batch, temperature, chunk_size, return_entropy, forward_kwargs,
                        prefix_pack=None, candidate_ids=None):
        # One body for both public entries, which FSDP registers separately (neither may call the other).
        if prefix_pack is not None:  # log-probs of response tokens only; prompt tokens get 0
            out = self.forward_packed(prefix_pack.input_ids, prefix_pack.batch, return_logits=False, **forward_kwargs)
            index = prefix_pack.response_index
            hidden = out.hidden_states.index_select(0, prefix_pack.response_rows)  # (R, D): the row before each
            cand = None if candidate_ids is None else candidate_ids.index_select(0, index)
            res = chunked_logprobs(hidden, self.lm_head.weight, input_ids.index_select(0, index), temperature,
                                   chunk_size, return_entropy, cand)

            def scatter(rows: torch.Tensor | None) -> torch.Tensor | None:
                if rows is None:
                    return None
                return rows.new_zeros(input_ids.shape[0], *rows.shape[1:]).index_copy(0, index, rows)

            out.candidate_logprobs = scatter(res.candidate_logprobs)
            return scatter(res.logprobs), scatter(res.entropy), out
        out = self.forward_packed(input_ids, batch, return_logits=False, **forward_kwargs)
        starts = batch.cu_seqlens_q[:-1]
        targets = torch.roll(input_ids, -1)  # row t predicts x_{t+1}
        cand = None if candidate_ids is None else torch.roll(candidate_ids, -1, dims=0)
        res = chunked_logprobs(out.hidden_states, self.lm_head.weight, targets, temperature, chunk_size,
                               return_entropy, cand)

        def to_token_rows(next_rows: torch.Tensor | None) -> torch.Tensor | None:
            if next_rows is None:
                return None
            return torch.roll(next_rows, 1, dims=0).index_fill_(0, starts, 0.0)  # index_fill: no host sync

        out.candidate_logprobs = to_token_rows(res.candidate_logprobs)
        return to_token_rows(res.logprobs), to_token_rows(res.entropy), out
