"""DSA attention and indexer ops behind one interface: a torch reference (any device) and Triton kernels (CUDA).

`set_backend("torch" | "triton" | "auto")` picks the path; "auto" uses Triton on CUDA tensors when the
kernels import, the torch reference otherwise. Batch-invariant mode (`invariant.set_enabled`, true on-policy)
overrides the backend: every op then takes the one reduction order of `slime_dsa/ops/invariant.py` (its Triton
kernels on CUDA, its torch blocks elsewhere).
Conventions (packing, causal alignment, tie rule) are documented in `slime_dsa/ops/reference.py` and hold for every backend.
"""

from __future__ import annotations

import torch

from slime_dsa.ops import invariant, reference
from slime_dsa.ops.fp8_keys import Fp8Keys, split_keys

_BACKENDS = ("auto", "torch", "triton")
_backend = "auto"


def set_backend(name: str) -> None:
    """Force the op backend for the whole process."""
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"ops backend {name!r} is not one of {_BACKENDS}")
    _backend = name


def get_backend() -> str:
    return _backend


def _kernels(device: torch.device):
    """The Triton kernel module when it should run on this device, else None."""
    if _backend == "torch" or device.type != "cuda":
        if _backend == "triton" and device.type != "cuda":
            raise RuntimeError("ops backend 'triton' needs CUDA tensors")
        return None
    try:
        from slime_dsa.ops import triton_kernels  # noqa: PLC0415 (imported only on CUDA)
    except ImportError:
        if _backend == "triton":
            raise
        return None
    return triton_kernels


# torch.compiler.disable on the two ops a decoder layer calls: where torch.compile traces a layer (trainer.compile), its
# graph breaks once at each, and they run as they do eagerly, instead of dynamo tracing their host-side logic
# (reads of sequence offsets, loops over sequences, Triton launches) into many small graphs recompiled per batch
# layout. Eagerly the decorator costs ~0.3 us a call.
@torch.compiler.disable
def indexer_topk(q, k, weights, cu_seqlens_q, cu_seqlens_k, topk: int, scale: float,
                 host_cu_seqlens: tuple[list[int], list[int]] | None = None) -> torch.Tensor:
    """Causal lightning-indexer top-k: (Tq, topk) sequence-local key positions, ascending, -1 padded.

    host_cu_seqlens: the two offsets as host lists when the caller has them, so the Triton path waits on no device.
    k: (Tk, Di) keys, or their FP8 rows (`fp8_keys.Fp8Keys`: an engine's FP8 index-key cache).
    """
    _check_plain_keys_if_invariant(k)
    if _longest_keys(cu_seqlens_k, host_cu_seqlens) <= topk:
        return _every_causal_key(cu_seqlens_q, cu_seqlens_k, q.shape[0], topk)
    kernels = None if invariant.is_enabled() else _kernels(q.device)
    if kernels is not None:
        values, key_scales = split_keys(k)
        return kernels.indexer_topk(q, values, weights, cu_seqlens_q, cu_seqlens_k, topk, scale, host_cu_seqlens,
                                    key_scales=key_scales)
    impl = invariant if invariant.is_enabled() else reference
    return impl.indexer_topk(q, k, weights, cu_seqlens_q, cu_seqlens_k, topk, scale)


def indexer_topk_paged(q, k_pool, weights, key_slots, seq_lens, topk: int, scale: float) -> torch.Tensor:
    """Decode top-k over a paged key pool (one query per sequence): (B, topk) sequence-local positions.

    No path syncs with the host on CUDA (batch-invariant mode's included: its Triton kernel), so an engine can
    capture it in a CUDA graph; the invariant torch path (CPU) reads key widths on the host. k_pool: (slots, Di)
    keys, or their FP8 rows (`fp8_keys.Fp8Keys`).
    """
    _check_plain_keys_if_invariant(k_pool)
    if key_slots.shape[1] <= topk:  # the table's width bounds every sequence's keys: static, so graph-safe
        return _first_keys(seq_lens, topk)
    kernels = None if invariant.is_enabled() else _kernels(q.device)
    if kernels is not None:
        values, key_scales = split_keys(k_pool)
        return kernels.indexer_topk_paged(q, values, weights, key_slots, seq_lens, topk, scale, key_scales=key_scales)
    impl = invariant if invariant.is_enabled() else reference
    return impl.indexer_topk_paged(q, k_pool, weights, key_slots, seq_lens, topk, scale)


def _longest_keys(cu_seqlens_k: torch.Tensor, host_cu_seqlens: tuple[list[int], list[int]] | None) -> float:
    """The longest sequence's key count, where known without waiting on a device (else inf)."""
    if host_cu_seqlens is not None:
        cu_k = host_cu_seqlens[1]
        return max((b - a for a, b in zip(cu_k, cu_k[1:])), default=0)
    if cu_seqlens_k.device.type == "cpu":
        return int(cu_seqlens_k.diff().max()) if len(cu_seqlens_k) > 1 else 0
    return float("inf")


def _every_causal_key(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, topk: int) -> torch.Tensor:
    """The selection when every query's causal keys fit in topk: all of them (packed rows)."""
    position = reference._query_positions(cu_seqlens_q, cu_seqlens_k, total_q)[1]  # (Tq,)
    return _first_keys(position + 1, topk)


def _first_keys(n_keys: torch.Tensor, topk: int) -> torch.Tensor:
    """(rows, topk) positions 0 .. n_keys[r] - 1, then -1: what scoring and selecting return, whatever the scores,
    when a row has at most topk keys (RL samples shorter than index_topk), without computing them."""
    cols = torch.arange(topk, device=n_keys.device)
    return torch.where(cols[None, :] < n_keys[:, None], cols[None, :], -1)


def _check_plain_keys_if_invariant(keys) -> None:
    if invariant.is_enabled() and isinstance(keys, Fp8Keys):
        raise ValueError("batch-invariant ops (true on-policy) score index keys in the model's dtype, not FP8: "
                         "an engine with rollout.index_key_cache_dtype fp8_e4m3 cannot run them")


@torch.compiler.disable
def sparse_mla_attention(
    q, kv, indices, scale: float, v_dim: int, cu_seqlens: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MQA attention of q (Tq, H, D) over kv rows `indices` (Tq, K): returns (out, lse).

    cu_seqlens: how q and kv are packed when they are the same rows (no cache); on the torch path, indices that
    select every causal key (a top-k at or above the sequence length) then run as dense causal attention.
    """
    if invariant.is_enabled():  # never dense, never split: decode, prefill and training alike
        return invariant.mla_attention(q, kv, indices, scale, v_dim)
    kernels = _kernels(q.device)
    if kernels is not None:
        return kernels.sparse_mla_attention(q, kv, indices, scale, v_dim)
    if cu_seqlens is not None and reference.selects_all_causal(indices, cu_seqlens):
        return reference.dense_mla_attention(q, kv, cu_seqlens, scale, v_dim)
    return reference.sparse_mla_attention(q, kv, indices, scale, v_dim)


def indexer_kl_loss(
    index_q, index_k, index_weights, index_scale: float, attn_q, attn_kv, attn_lse, attn_scale: float,
    cu_seqlens_q, cu_seqlens_k, rows=None,
) -> torch.Tensor:
    """Indexer KL loss of one IndexShare group, per query row (Tq,); see `reference.indexer_kl_loss`."""
    impl = _kernels(index_q.device) or reference
    return impl.indexer_kl_loss(
        index_q, index_k, index_weights, index_scale, attn_q, attn_kv, attn_lse, attn_scale,
        cu_seqlens_q, cu_seqlens_k, rows,
    )


__all__ = [
    "set_backend", "get_backend", "invariant", "indexer_topk", "indexer_topk_paged", "sparse_mla_attention", "indexer_kl_loss", "reference",
]
