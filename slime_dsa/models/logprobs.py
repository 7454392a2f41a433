"""Per-token log-probs of given tokens without materialising the full-vocabulary float32 logits at once."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


KEEP_LOGITS_ELEMENTS = 1 << 20  # float32 logits blocks up to 4 MiB are not recomputed in backward


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float, want_entropy: bool):
    logits = (hidden @ weight.T).float() / temperature  # (C, V): the only float32 logits alive at a time
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(1, targets[:, None]).squeeze(1) - logz
    if not want_entropy:
        return logp, logp.new_zeros(())
    probs = torch.softmax(logits, dim=-1)
    entropy = logz - (probs * logits).sum(-1)
    return logp, entropy


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(hidden @ weightᵀ / temperature)[targets], row by row in chunks.

    hidden (N, D), weight (V, D), targets (N,) -> logprobs (N,) float32 [, entropy (N,)]. Under autograd each
    chunk over KEEP_LOGITS_ELEMENTS logits is recomputed in backward (activation checkpointing), so memory stays
    at one chunk of logits.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    logps, ents = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        args = (hidden[start : start + chunk_size], weight, targets[start : start + chunk_size], temperature, return_entropy)
        # Small logits blocks are kept for backward: recomputing them costs more than the memory saved.
        small = args[0].shape[0] * weight.shape[0] <= KEEP_LOGITS_ELEMENTS
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad) and not small:
            logp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            logp, ent = _chunk_logprobs(*args)
        logps.append(logp)
        ents.append(ent)
    logp = torch.cat(logps) if logps else hidden.new_zeros(0, dtype=torch.float32)
    return logp, (torch.cat(ents) if return_entropy and ents else None)
