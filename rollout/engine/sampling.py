"""Batched token sampling as pure functions of tensors: one row per request, no loop over the vocabulary.

Order of operations (SGLang's): stop tokens masked while a row is under min_new_tokens -> temperature ->
top-k / top-p / min-p, all three judged on the temperature-scaled distribution sorted once -> renormalise ->
draw by inverse CDF with one uniform number per row. The uniform comes from the request's own
torch.Generator when it has a sampling_seed, so a seeded request draws the same tokens whatever else is
in the batch.

Log-probs (the `rollout_logprobs` RL needs): a sampled token's log-prob is taken under the distribution it
was actually drawn from, i.e. log_softmax of the filtered, temperature-scaled logits (renormalised over the
kept set). A greedy row (temperature < 1e-6 or top_k == 1) reports log_softmax of the raw logits (temperature
1, no filtering) at the argmax: the log-prob a temperature-1 trainer forward computes for that token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.engine.types import SamplingParams

GREEDY_TEMPERATURE = 1e-6


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors on the logits' device. B rows."""

    temperature: torch.Tensor  # (B,) float32, 1.0 on greedy rows
    top_k: torch.Tensor  # (B,) int64, vocab size where unrestricted
    top_p: torch.Tensor  # (B,) float32
    min_p: torch.Tensor  # (B,) float32
    greedy: torch.Tensor  # (B,) bool
    all_greedy: bool
    needs_sort: bool  # some sampled row restricts top_k or top_p
    needs_min_p: bool

    @classmethod
    def from_params(cls, params: list[SamplingParams], vocab_size: int, device: torch.device | str) -> "SamplingBatch":
        greedy = [p.greedy for p in params]
        if all(greedy):  # argmax only: no parameter tensors needed
            empty = torch.empty(0, device=device)
            return cls(empty, empty, empty, empty, empty, all_greedy=True, needs_sort=False, needs_min_p=False)
        temperature = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        top_k = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]
        top_p = [float(p.top_p) for p in params]
        min_p = [float(p.min_p) for p in params]
        sampled = [not g for g in greedy]
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32).to(device, non_blocking=True),
            top_k=torch.tensor(top_k, dtype=torch.long).to(device, non_blocking=True),
            top_p=torch.tensor(top_p, dtype=torch.float32).to(device, non_blocking=True),
            min_p=torch.tensor(min_p, dtype=torch.float32).to(device, non_blocking=True),
            greedy=torch.tensor(greedy, dtype=torch.bool).to(device, non_blocking=True),
            all_greedy=all(greedy),
            needs_sort=any(s and (k < vocab_size or p < 1.0) for s, k, p in zip(sampled, top_k, top_p)),
            needs_min_p=any(s and m > 0 for s, m in zip(sampled, min_p)),
        )


def mask_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Set logits[rows[i], token_ids[i]] = -inf (stop tokens of requests under min_new_tokens). In place."""
    if rows.numel():
        logits[rows, token_ids] = float("-inf")
    return logits


def filter_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature-scaled logits with everything outside top-k / top-p / min-p set to -inf. (B, V) -> (B, V)."""
    scaled = logits / batch.temperature[:, None]
    if not (batch.needs_sort or batch.needs_min_p):
        return scaled
    if batch.needs_sort:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)  # (B, V)
        probs = torch.softmax(sorted_logits, dim=-1)
        rank = torch.arange(scaled.shape[-1], device=scaled.device)
        remove = rank[None, :] >= batch.top_k[:, None]
        remove |= (probs.cumsum(-1) - probs) > batch.top_p[:, None]  # keep the smallest prefix reaching top_p
        if batch.needs_min_p:
            remove |= probs < (batch.min_p * probs[:, 0])[:, None]
        remove[:, 0] = False  # the most likely token always survives
        remove = torch.empty_like(remove).scatter_(1, order, remove)  # back to vocabulary order
    else:
        probs = torch.softmax(scaled, dim=-1)
        remove = probs < (batch.min_p * probs.max(dim=-1).values)[:, None]
    return scaled.masked_fill(remove, float("-inf"))


def sample_inverse_cdf(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from exp(logprobs) (B, V) with uniforms (B,) in [0, 1). Zero-probability tokens are never drawn."""
    probs = logprobs.exp()
    cdf = probs.cumsum(dim=-1)  # (B, V)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1])[:, None]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)  # first index with cdf > target
    # Rounding can push the target to the total: fall back to the last token that has probability.
    vocab = torch.arange(probs.shape[-1], device=probs.device)
    last_kept = torch.where(probs > 0, vocab[None, :], 0).amax(dim=-1)
    return torch.minimum(tokens, last_kept)


def sample(logits: torch.Tensor, batch: SamplingBatch, uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row: logits (B, V) float32 -> (token ids (B,) int64, log-probs (B,) float32)."""
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    greedy_tokens = logits.argmax(dim=-1)
    greedy_logprobs = raw_logprobs.gather(1, greedy_tokens[:, None]).squeeze(1)
    if batch.all_greedy:
        return greedy_tokens, greedy_logprobs
    logprobs = torch.log_softmax(filter_logits(logits, batch), dim=-1)  # the distribution sampled from
    tokens = sample_inverse_cdf(logprobs, uniforms)
    sampled_logprobs = logprobs.gather(1, tokens[:, None]).squeeze(1)
    return (
        torch.where(batch.greedy, greedy_tokens, tokens),
        torch.where(batch.greedy, greedy_logprobs, sampled_logprobs),
    )
