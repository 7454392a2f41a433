"""Compile an engine's kernels and capture its decode graphs before the first rollout.

Without it the first RL step pays for them (on the H200, 7 s of a 22 s first step: Triton compiling the prefill and
decode kernels, then the decode graphs of each block-table width), and a later step pays again when the first answer
reaches a wider block table. The engine runs a few requests of the rollout path's kind (log-probs, a seed, the
DSA top-k where it keeps it) and captures every width up to the longest sample, then forgets them (prefix cache).
"""

from __future__ import annotations

import logging
import time

import torch

from rollout.engine.engine import Engine
from rollout.engine.types import GenerateRequest, SamplingParams

logger = logging.getLogger(__name__)

SHORT_PROMPT = 64  # a prefill within index_topk at any preset
NEW_TOKENS = 4


def warmup_prompt_lengths(max_len: int, index_topk: int) -> list[int]:
    """Prompt lengths whose prefills compile each path: within index_topk (two, of both parities) and past it."""
    room = max_len - NEW_TOKENS
    short = min(SHORT_PROMPT, index_topk, room)
    lengths = [short, short - 1] if short > 1 else [short]
    if room > index_topk:
        lengths.append(room)
    return [n for n in lengths if n > 0]


def prefill_rounds(max_len: int, index_topk: int) -> list[list[int]]:
    """Prompt lengths of each warm-up prefill: one prompt and several (kernels specialise a count of 1), of rows
    both a multiple of 16 and odd, and the long prompt past index_topk alone."""
    lengths = warmup_prompt_lengths(max_len, index_topk)
    short = lengths[:2]
    rounds = [[n] for n in short] + [[short[0], n] for n in short]
    return rounds + [[n] for n in lengths[2:]]


def graph_widths(max_len: int, block_size: int) -> list[int]:
    """The decode block-table widths (powers of two, in blocks) that samples of up to max_len tokens reach."""
    widest = 1 << (max(1, -(-max_len // block_size)) - 1).bit_length()
    return [1 << i for i in range(widest.bit_length())]


def warm_up_engine(engine: Engine, max_len: int) -> float:
    """Run the warm-up on an idle engine (before its server starts): seconds taken. The prefix cache is flushed
    after; the engine's counters keep the warm-up (the orchestrator resets them before step 1)."""
    start = time.perf_counter()
    vocab, topk = engine.config.vocab_size, engine.config.index_topk
    generator = torch.Generator().manual_seed(0)
    for i, lengths in enumerate(prefill_rounds(max_len, topk)):
        for j, n in enumerate(lengths):
            ids = torch.randint(vocab, (n,), generator=generator).tolist()
            sampling = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, sampling_seed=10 * i + j)
            engine.add_request(GenerateRequest(ids, sampling, return_logprob=True, stream=False,
                                               return_indexer_topk=engine.cache.keep_topk))
        while engine.has_work:  # one round per prefill: its row count and its number of sequences are the round's
            engine.step()
    if engine.decoder is not None and engine.decoder.use_cuda_graphs:
        largest = engine.decoder.batch_ladder[-1]
        for width in graph_widths(max_len, engine.block_size):
            engine.decoder.capture_width(largest, width)
    engine.flush_cache()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return time.perf_counter() - start


def warm_up_or_recover(engine: Engine, max_len: int) -> float | None:
    """warm_up_engine's seconds, or None when it failed: then the engine is left as a fresh one (requests aborted,
    prefix cache flushed, decode graphs and their pool dropped, cached device memory freed), and its first rollout
    compiles and captures instead. A failed warm-up costs its time, not the engine."""
    try:
        return warm_up_engine(engine, max_len)
    except Exception:  # noqa: BLE001 - e.g. out of memory while capturing a large batch's graph
        logger.exception("engine: warm-up failed; the first rollout compiles and captures instead")
        engine.abort(abort_all=True)
        engine.flush_cache()
        if engine.decoder is not None:
            engine.decoder.reset()
        if engine.device.type == "cuda":
            torch.cuda.empty_cache()
        return None
