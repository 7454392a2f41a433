"""A decode step's sampling as one CUDA graph: the LM head, the stop-id mask, the seeded draw, the log-probs and the
finish codes, replayed after the decode forward's graph instead of about 25 eager launches a step.

With short answers the engine's decode steps were host-bound (a tiny model's step is ~2 ms on the GPU): the sampling
ops' launches were a third of a step's host time. One graph is captured per (batch bucket, sampling variant), the
variant being what changes the ops: `SamplingRows.flags`, the stop-id width and, with stop strings, the completer
table. Its inputs are static buffers: the decode forward's hidden states, the rows' parameters (copied when the rows
change) and their output counts. The uniforms are the hash of each row's seed and output count
(`sampling.counter_uniforms`), the values `SamplingRows.uniforms` serves from its draws made ahead. Padding rows
(bucket sizes) sample from stale rows nobody reads.

The graphs share one memory pool of their own, which keeps the largest graph's intermediates (several copies of the
logits), so only steps of at most MAX_GRAPH_LOGITS logits are graphed: a real vocabulary's large batches (GPU-bound
anyway) sample eagerly and their memory returns to the allocator. Replays are stream-ordered: a graph's outputs are
read (copied to the host, fed to the next forward, copied into the next graph's counts) before the next replay
writes the pool.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from rollout.engine.rows import NEVER, SAMPLED, SEED, STOP_STRINGS, STREAMS, SamplingRows
from rollout.engine.sampling import counter_uniforms, exact_logprobs, sample

logger = logging.getLogger(__name__)

MAX_GRAPH_LOGITS = 1 << 24  # float32 logits of a graphed step (64 MiB): 43,690 rows of the small preset's 384 tokens


def sample_rows(logits: torch.Tensor, rows: SamplingRows, num_output: torch.Tensor, uniforms: torch.Tensor | None,
                completers: torch.Tensor, exact_temperatures: list[float] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row from float32 logits (B, V) (stop ids masked in place) -> (result (3, B) float64:
    tokens, log-probs, finish codes; tokens (B,) int64; the output counts with this token (B,)).
    `exact_temperatures`: true on-policy log-probs at these temperatures (sampling.exact_logprobs)."""
    rows.mask_stop_ids(logits, num_output)
    tokens, logprobs = sample(logits, rows.sampling, uniforms)
    if exact_temperatures is not None:
        logprobs = exact_logprobs(logits, tokens, exact_temperatures)
    count = num_output + 1
    codes = rows.finish_codes(tokens, num_output, completers, count=count)
    result = torch.empty((3, len(tokens)), dtype=torch.float64, device=logits.device)
    torch.stack([tokens, logprobs, codes], out=result)  # the casts inside the stack
    return result, tokens, count


def seeded_uniforms(rows: SamplingRows, num_output: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The step's uniforms straight from the hash: SamplingRows.uniforms' values without its draws made ahead."""
    if not rows.flags & SAMPLED:
        return None
    return counter_uniforms(rows.ints[:, SEED], num_output).to(dtype)


@dataclass
class _SampleGraph:
    """One captured sampling step of B rows and its static buffers."""

    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # (B, D): a copy of the decode forward's output
    floats: torch.Tensor  # (B, 3), ints (B, 9), stop_ids (B, S): SamplingRows' tensors, rows [:n] copied
    ints: torch.Tensor
    stop_ids: torch.Tensor
    num_output: torch.Tensor  # (B,)
    result: torch.Tensor  # (3, B) float64
    tokens: torch.Tensor  # (B,)
    count: torch.Tensor  # (B,)
    rows: SamplingRows | None = None  # the rows whose parameters the buffers hold


class SamplingGraphs:
    """Sampling steps replayed from CUDA graphs, keyed by (batch bucket, variant); captured on first use."""

    def __init__(self, lm_head: nn.Module, vocab_size: int, stats: dict[str, float]) -> None:
        self.lm_head, self.vocab_size, self.stats = lm_head, vocab_size, stats
        self.stats.setdefault("sample_graph_captures", 0)
        self.stats.setdefault("sample_graph_capture_s", 0.0)
        self._graphs: dict[tuple, _SampleGraph] = {}
        self._pool = None
        self.enabled = True  # off after a failed capture: steps sample eagerly from then on

    def reset(self) -> None:
        """Drop every graph and their pool (the memory they read moved)."""
        self._graphs.clear()
        self._pool = None

    def fits(self, rows: int) -> bool:
        """Whether a step of `rows` (its bucket) is small enough to sample from a graph (MAX_GRAPH_LOGITS)."""
        return self.enabled and rows * self.vocab_size <= MAX_GRAPH_LOGITS

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def run(self, hidden: torch.Tensor, rows: SamplingRows, num_output: torch.Tensor,
            completers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """hidden (B, D) padded to its bucket, rows and num_output (n,) of the n real rows -> (result (3, B), tokens
        (B,), counts (B,)): static buffers that the next sampling replay may overwrite (their readers queue first).
        None when the graph could not be captured (logged once; the caller samples eagerly)."""
        B, n = hidden.shape[0], len(num_output)
        strings = bool(rows.flags & STOP_STRINGS)
        key = (B, rows.flags & ~STREAMS, rows.stop_ids.shape[1],
               (completers.data_ptr(), completers.shape[0]) if strings else None)
        graph = self._graphs.get(key)
        if graph is None:
            try:
                graph = self._graphs[key] = self._capture(key, hidden, completers)
            except RuntimeError:  # a failed capture leaves its memory pool unusable: no sampling graphs from here on
                logger.exception("engine: sampling graph capture failed; sampling eagerly from now on")
                self.enabled = False
                self.reset()
                return None
        graph.hidden.copy_(hidden)
        if graph.rows is not rows:
            graph.floats[:n].copy_(rows.floats)
            graph.ints[:n].copy_(rows.ints)
            graph.stop_ids[:n].copy_(rows.stop_ids)
            graph.rows = rows
        graph.num_output[:n].copy_(num_output)
        graph.graph.replay()
        return graph.result, graph.tokens, graph.count

    def _capture(self, key: tuple, hidden: torch.Tensor, completers: torch.Tensor) -> _SampleGraph:
        start = time.perf_counter()
        B, flags, width, _ = key
        device = hidden.device
        floats = torch.tensor([1.0, 1.0, 0.0], device=device).repeat(B, 1)  # temperature 1, top_p 1, min_p 0
        # A row that samples freely and never ends: greedy 0, top_k the vocabulary, seed 0, min_new 0, max_new NEVER,
        # no completer, completer row 0, no stop strings, stop ids from its first token (RowSpec.ints' columns).
        ints = torch.tensor([0, self.vocab_size, 0, 0, NEVER, -1, 0, NEVER, 0], device=device).repeat(B, 1)
        stop_ids = torch.full((B, width), -1, dtype=torch.long, device=device)
        static = dict(hidden=torch.empty_like(hidden), floats=floats, ints=ints, stop_ids=stop_ids,
                      num_output=torch.zeros(B, dtype=torch.long, device=device))
        static["hidden"].copy_(hidden)

        def step() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            # Fresh rows each call: SamplingRows caches tensors derived from its buffers (the greedy mask), which the
            # graph must recompute at every replay, not read from the warm-up.
            view = SamplingRows(key=(), floats=floats, ints=ints, stop_ids=stop_ids, flags=flags, string_rows=[],
                                stream_rows=[], row_flags=np.zeros(0, dtype=np.int64))
            logits = self.lm_head(static["hidden"]).float()
            uniforms = seeded_uniforms(view, static["num_output"], logits.dtype)
            return sample_rows(logits, view, static["num_output"], uniforms, completers)

        # Warm up on a side stream (lazy initialisation and cached aranges outside the capture), then capture without
        # torch.cuda.graph's device synchronisation and cache flush: the step before may still run (overlap).
        current = torch.cuda.current_stream(device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.stream(stream):
            step()
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                result, tokens, count = step()
            finally:
                graph.capture_end()
        current.wait_stream(stream)
        self.stats["sample_graph_captures"] += 1
        self.stats["sample_graph_capture_s"] += time.perf_counter() - start
        logger.debug("engine: captured a sampling graph for %d rows (flags %d, %d stop ids)", B, flags, width)
        return _SampleGraph(graph=graph, result=result, tokens=tokens, count=count, **static)
