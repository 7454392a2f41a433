"""Per-token log-probs of given tokens without materialising the full-vocabulary float32 logits at once.

Besides the log-prob of each row's target token, one pass over a chunk of logits can also give the log-probs of
a few candidate ids per row (a teacher's top-k, for a sparse KL) and the row's own top-k (teacher scoring).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from slime_dsa.ops import invariant

# Logits kept for backward rather than recomputed: a chunk's up to 4 MiB (float32), or all of a call's up to 64 MiB
KEEP_LOGITS_ELEMENTS = 1 << 20
KEEP_CALL_LOGITS_ELEMENTS = 1 << 24
CHUNK_LOGITS_ELEMENTS = 1 << 24  # on a GPU a small vocabulary's chunks take more rows, up to this many logits


@dataclass
class ChunkedLogprobs:
    """What `chunked_logprobs` returns; fields are None unless asked for. N rows, K candidates, k top ids."""

    logprobs: torch.Tensor  # (N,) float32 log-prob of each row's target
    entropy: torch.Tensor | None = None  # (N,) entropy of each row's distribution
    candidate_logprobs: torch.Tensor | None = None  # (N, K) log-probs of the rows' candidate ids
    topk_logprobs: torch.Tensor | None = None  # (N, k) the row's k largest log-probs, descending
    topk_ids: torch.Tensor | None = None  # (N, k) their token ids


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float, want_entropy: bool,
           candidates: torch.Tensor | None, top_k: int) -> tuple[torch.Tensor, ...]:
    exact = invariant.is_enabled()  # true on-policy: the engine's lm_head and log-prob ops, bit for bit
    raw = (invariant.linear(hidden, weight) if exact else hidden @ weight.T).float()  # (C, V)
    logits = raw / temperature  # the only float32 logits alive at a time
    logz = torch.logsumexp(logits, dim=-1)
    if exact:
        logp = invariant.log_softmax_gather(raw, targets, temperature)
    else:
        logp = logits.gather(1, targets[:, None]).squeeze(1) - logz
    out = [logp]
    if want_entropy:
        probs = torch.softmax(logits, dim=-1)
        out.append(logz - (probs * logits).sum(-1))
    if candidates is not None:
        out.append(logits.gather(1, candidates) - logz[:, None])  # (C, K)
    if top_k:
        values, ids = logits.topk(top_k, dim=-1)
        out += [values - logz[:, None], ids]
    return tuple(out)


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    candidate_ids: torch.Tensor | None = None,
    top_k: int = 0,
) -> ChunkedLogprobs:
    """log softmax(hidden @ weightᵀ / temperature) at each row's target (and candidates, and its top-k), in chunks.

    hidden (N, D), weight (V, D), targets (N,), candidate_ids (N, K). A chunk holds chunk_size rows; on a GPU more
    where the vocabulary is small (up to CHUNK_LOGITS_ELEMENTS logits), since every chunk costs a dozen kernel
    launches each way (~25 chunks a step at a 384-token vocabulary), while on a CPU chunks that fit its caches run
    faster (one wide chunk took twice as long: benchmarks/logprob_chunks_host_time.py). Under autograd a chunk over
    KEEP_LOGITS_ELEMENTS logits, in a call over KEEP_CALL_LOGITS_ELEMENTS, is recomputed in backward (activation
    checkpointing), so memory stays at one chunk of logits. top_k > 0 is for scoring without gradient (its ids are
    not differentiable).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    if candidate_ids is not None and candidate_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"candidate_ids has {candidate_ids.shape[0]} rows, hidden has {hidden.shape[0]}")
    if not 0 <= top_k <= weight.shape[0]:
        raise ValueError(f"top_k must be in [0, vocab size {weight.shape[0]}], got {top_k}")
    parts: list[tuple[torch.Tensor, ...]] = []
    if hidden.device.type != "cpu":
        chunk_size = max(chunk_size, CHUNK_LOGITS_ELEMENTS // max(weight.shape[0], 1))
    # Small logits are kept for backward: recomputing them costs more than the memory saved.
    small_call = hidden.shape[0] * weight.shape[0] <= KEEP_CALL_LOGITS_ELEMENTS
    for start in range(0, hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        args = (hidden[rows], weight, targets[rows], temperature, return_entropy,
                None if candidate_ids is None else candidate_ids[rows], top_k)
        small = small_call or args[0].shape[0] * weight.shape[0] <= KEEP_LOGITS_ELEMENTS
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad) and not small:
            parts.append(checkpoint(_chunk, *args, use_reentrant=False))
        else:
            parts.append(_chunk(*args))
    if not parts:
        return _empty(hidden, candidate_ids, top_k, return_entropy)
    columns = [torch.cat(col) for col in zip(*parts)]
    out = ChunkedLogprobs(logprobs=columns.pop(0))
    if return_entropy:
        out.entropy = columns.pop(0)
    if candidate_ids is not None:
        out.candidate_logprobs = columns.pop(0)
    if top_k:
        out.topk_logprobs, out.topk_ids = columns
    return out


def _empty(hidden: torch.Tensor, candidate_ids: torch.Tensor | None, top_k: int, entropy: bool) -> ChunkedLogprobs:
    zeros = hidden.new_zeros(0, dtype=torch.float32)
    k = 0 if candidate_ids is None else candidate_ids.shape[1]
    return ChunkedLogprobs(
        logprobs=zeros, entropy=zeros if entropy else None,
        candidate_logprobs=None if candidate_ids is None else hidden.new_zeros(0, k, dtype=torch.float32),
        topk_logprobs=hidden.new_zeros(0, top_k, dtype=torch.float32) if top_k else None,
        topk_ids=hidden.new_zeros(0, top_k, dtype=torch.long) if top_k else None)


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs (N,) float32, entropy (N,) or None): `chunked_logprobs` of the targets only."""
    out = chunked_logprobs(hidden, weight, targets, temperature, chunk_size, return_entropy)
    return out.logprobs, out.entropy
