"""Batched token sampling as pure functions of tensors: one row per request, no loop over the vocabulary.

Order of operations (SGLang's): stop tokens masked while a row is under min_new_tokens -> temperature ->
top-k / top-p / min-p, all three judged on the temperature-scaled distribution sorted once -> renormalise ->
draw by inverse CDF with one uniform number per row. The uniforms of a step are one batched draw on the device:
row b gets splitmix64(seed_b, n_b), a counter-based hash of its request's seed and the index n_b of the token it
draws (`counter_uniforms`). A request with a sampling_seed therefore draws the same tokens whatever else is in the
batch, and after a retract; one without gets a seed from the engine's generator when it arrives.

Log-probs (the `rollout_logprobs` RL needs): a sampled token's log-prob is taken under the distribution it
was actually drawn from, i.e. log_softmax of the filtered, temperature-scaled logits (renormalised over the
kept set). A greedy row (temperature < 1e-6 or top_k == 1) reports log_softmax of the raw logits (temperature
1, no filtering) at the argmax: the log-prob a temperature-1 trainer forward computes for that token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slime_dsa.ops import invariant

GREEDY_TEMPERATURE = 1e-6

# splitmix64 (Steele, Lea, Flood 2014; Vigna's reference code) on int64 tensors, constants as two's-complement int64.
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def seed_to_int64(seed: int) -> int:
    """A seed in [-2**63, 2**64) as the int64 with the same low 64 bits."""
    seed &= 2**64 - 1
    return seed - 2**64 if seed >= 2**63 else seed


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on signed integers)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def counter_uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Uniforms in [0, 1): output `counters` (B,) of splitmix64 seeded with `seeds` (B,), both int64 -> (B,) float64.

    Integer multiplication wraps modulo 2**64 on every torch backend, as the hash needs."""
    z = seeds + (counters + 1) * _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 11).double() * 2.0**-53  # the top 53 bits


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors on the logits' device, B rows (rows.SamplingRows keeps them)."""

    temperature: torch.Tensor  # (B,) float32, 1.0 on greedy rows
    top_k: torch.Tensor  # (B,) int64, vocab size where unrestricted
    top_p: torch.Tensor  # (B,) float32
    min_p: torch.Tensor  # (B,) float32
    greedy: torch.Tensor  # (B,) bool
    all_greedy: bool
    any_greedy: bool  # some row is greedy (else no row needs the raw log-probs)
    needs_sort: bool  # some sampled row restricts top_k or top_p
    needs_min_p: bool
    scales: bool = True  # some row's temperature is not 1 (dividing by 1 changes no bit: skipped)


def cached_arange(n: int, device: torch.device) -> torch.Tensor:
    """arange(n) (int64) on `device`, made once per (n, device): no op per step."""
    out = _ARANGES.get((n, device))
    if out is None:
        if len(_ARANGES) >= 64:
            _ARANGES.clear()
        out = _ARANGES[(n, device)] = torch.arange(n, device=device)
    return out


_ARANGES: dict[tuple[int, torch.device], torch.Tensor] = {}


def filter_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature-scaled logits with everything outside top-k / top-p / min-p set to -inf. (B, V) -> (B, V)."""
    scaled = logits / batch.temperature[:, None] if batch.scales else logits
    if not (batch.needs_sort or batch.needs_min_p):
        return scaled
    if batch.needs_sort:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)  # (B, V)
        probs = torch.softmax(sorted_logits, dim=-1)
        rank = cached_arange(scaled.shape[-1], scaled.device)
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
    vocab = cached_arange(probs.shape[-1], probs.device)
    last_kept = torch.where(probs > 0, vocab[None, :], 0).amax(dim=-1)
    return torch.minimum(tokens, last_kept)


def sample(logits: torch.Tensor, batch: SamplingBatch, uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row: logits (B, V) float32 -> (token ids (B,) int64, log-probs (B,) float32)."""
    if batch.all_greedy:
        return _greedy(logits)
    logprobs = torch.log_softmax(filter_logits(logits, batch), dim=-1)  # the distribution sampled from
    tokens = sample_inverse_cdf(logprobs, uniforms)
    sampled_logprobs = logprobs.gather(1, tokens[:, None]).squeeze(1)
    if not batch.any_greedy:
        return tokens, sampled_logprobs
    greedy_tokens, greedy_logprobs = _greedy(logits)
    return (
        torch.where(batch.greedy, greedy_tokens, tokens),
        torch.where(batch.greedy, greedy_logprobs, sampled_logprobs),
    )


def _greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The argmax of each row and its log-prob under the raw logits (temperature 1, nothing filtered)."""
    tokens = logits.argmax(dim=-1)
    return tokens, torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)


def exact_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """True on-policy log-probs: (B,) float32 log_softmax(logits / temperature) at the tokens, by the op the trainer
    runs (`invariant.log_softmax_gather`) at each row's temperature (1 on greedy rows), unfiltered."""
    if len(set(temperatures)) == 1:
        return invariant.log_softmax_gather(logits, tokens, temperatures[0])
    out = torch.empty(len(temperatures), dtype=torch.float32, device=logits.device)
    for t in sorted(set(temperatures)):  # the op is row-wise: each temperature's rows alone give the same bits
        rows = torch.tensor([i for i, u in enumerate(temperatures) if u == t], device=logits.device)
        out[rows] = invariant.log_softmax_gather(logits[rows], tokens[rows], t)
    return out
