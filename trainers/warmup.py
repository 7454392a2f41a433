"""Synthetic micro-batches that make a rank compile its training kernels before the first step.

Triton compiles a kernel the first time a launch meets a new variant of it: an attention path (every query's keys a
causal range while sequences fit index_topk; selected keys past it) or an integer argument's divisibility by 16. An
RL run meets the first variants in step 1 and others whenever the first answer past index_topk arrives, mid-run (a
19 s step on the H200: benchmarks/RESULTS.md). One forward and backward over each variant at start-up moves that cost
before the first step, where it overlaps the engines' start; Triton's disk cache keeps it for later runs.
"""

from __future__ import annotations

import torch

from trainers.base import TrainBatch

PROMPT_TOKENS = 16  # each warm-up pair shares a prompt, as a step's groups do (shared-prompt packing)
SHORT_TOKENS = 48  # a sample within index_topk at any preset
MASKED_RANGE_RATIO = 4  # past this many times index_topk, rows' selections no longer fit short ranges (sparse_mla)


def warmup_lengths(max_len: int, index_topk: int) -> list[int]:
    """Sample lengths, one per attention path a run whose samples reach `max_len` tokens can take: within
    index_topk, past it, and past MASKED_RANGE_RATIO times it."""
    lengths = [min(SHORT_TOKENS, index_topk, max_len)]
    if max_len > index_topk:
        lengths.append(min(max_len, 2 * index_topk))
    if max_len > MASKED_RANGE_RATIO * index_topk:
        lengths.append(max_len)
    return sorted({n for n in lengths if n > PROMPT_TOKENS})


def _pair(lengths: list[int], vocab_size: int, generator: torch.Generator) -> TrainBatch:
    """Samples of the given lengths sharing their first PROMPT_TOKENS tokens, with the loss on the rest."""
    prompt = torch.randint(vocab_size, (PROMPT_TOKENS,), generator=generator)
    ids = torch.cat([torch.cat([prompt, torch.randint(vocab_size, (n - PROMPT_TOKENS,), generator=generator)])
                     for n in lengths])
    mask = torch.cat([torch.cat([torch.zeros(PROMPT_TOKENS), torch.ones(n - PROMPT_TOKENS)]) for n in lengths])
    signs = torch.cat([torch.full((n,), 1.0 if i % 2 == 0 else -1.0) for i, n in enumerate(lengths)])
    zeros = torch.zeros(len(ids))
    return TrainBatch(input_ids=ids, seqlens=list(lengths), loss_mask=mask, rollout_logprobs=zeros,
                      advantages=signs * mask, old_logprobs=zeros.clone(), prompt_lens=[PROMPT_TOKENS] * len(lengths))


def warmup_batches(max_len: int, index_topk: int, vocab_size: int, token_budget: int, seed: int = 0) -> list[TrainBatch]:
    """Two micro-batches per warm-up length: packed sizes of both parities (a multiple of 16 and an odd number), so
    both specialisations of the kernels' row counts compile. A pair that exceeds token_budget is split in two."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for n in warmup_lengths(max_len, index_topk):
        pair = [n - n % 8, n - n % 8 - 1] if n >= PROMPT_TOKENS + 16 else [n, n - 1]
        if sum(pair) <= token_budget:
            out += [_pair([pair[0], pair[0]], vocab_size, generator), _pair(pair, vocab_size, generator)]
        else:
            out += [_pair([length], vocab_size, generator) for length in pair]
    return out
