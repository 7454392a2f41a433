"""Decode steps over the paged cache: each request adds one token and attention reads the pool in place.

In a decode-only step (the common case once prompts are prefilled) no key row is gathered. Each full
layer's indexer scores the sequence's keys straight from the pool through its block table
(`ops.indexer_topk_paged`), and sparse MLA reads the selected slots. Nothing in that forward waits on the
host. On CUDA the forward is therefore captured once per bucket (batch size, block-table width) in a CUDA
graph and replayed: one launch instead of about a thousand. The eager step was launch-bound; see the engine
benchmarks in benchmarks/RESULTS.md.

Buckets: a batch is padded to the next bucket size with rows that write into the cache's scratch block,
and block tables are padded with the scratch block to a power of two of blocks. The first step at a table
width captures that width's graphs for every batch bucket the engine can run. A graph holds the
addresses of the weights, the KV pool and the experts' stacked weights. Weight updates copy in place, so
the graphs stay valid (`refresh` rebuilds the derived copies in place). Releasing memory must call `reset`.
"""

from __future__ import annotations

import itertools
import logging
import time
from bisect import bisect_left
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from rollout.engine.kv_cache import PagedKVCache
from rollout.engine.rows import SamplingRows
from rollout.engine.sample_graph import SamplingGraphs
from slime_dsa import ops
from slime_dsa.models import GlmMoeDsaForCausalLM, PackedBatch, fused_pointwise

logger = logging.getLogger(__name__)

# Batch sizes a graph is captured for: padding costs at most a third of the rows, and few graphs are needed. They
# reach the running-request caps RL recipes derive (recipes/gpu_single.yaml: 4,096 with dynamic sampling): a batch past
# the last bucket decodes eagerly, ~1,000 launches a step.
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096,
                 6144, 8192)


class PagedDecodeBatch(PackedBatch):
    """One new token per sequence; attention reads keys from the paged pool by slot instead of a packed copy."""

    def __init__(self, positions: torch.Tensor, block_table: torch.Tensor, block_size: int, cache: PagedKVCache) -> None:
        """positions (B,) of the new tokens; block_table (B, W) cache blocks of each sequence (scratch-padded)."""
        B, device = positions.shape[0], positions.device
        offsets = torch.arange(block_size, device=device)
        self.key_slots = (block_table[:, :, None] * block_size + offsets).reshape(B, -1)  # (B, W * block_size)
        self.seq_lens = positions + 1  # keys of each sequence, the new token's own included
        block = block_table.gather(1, (positions // block_size)[:, None]).squeeze(1)
        self.positions = positions
        self.cu_seqlens_q = torch.arange(B + 1, device=device)
        self.cu_seqlens_k = F.pad(self.seq_lens.cumsum(0), (1, 0))
        self.write_slots = block * block_size + positions % block_size  # (B,) where the new rows go
        self.kv_cache = cache.bind_pool(self.write_slots)

    def select_topk(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, scale: float) -> torch.Tensor:
        """k is the whole index-key pool of the layer; returns (B, topk) sequence-local positions, -1 padded."""
        return ops.indexer_topk_paged(q, k, weights, self.key_slots, self.seq_lens, topk, scale)

    def to_rows(self, local_indices: torch.Tensor) -> torch.Tensor:
        """Sequence-local positions (B, K) -> pool slots, -1 kept."""
        slots = self.key_slots.gather(1, local_indices.clamp(min=0))
        return torch.where(local_indices >= 0, slots, -1)


@dataclass
class _Graph:
    """One captured decode forward: static inputs (ids | positions | block table, flat) and outputs."""

    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # (B * (2 + W),) int64 on the device
    staging: torch.Tensor  # the same layout in pinned host memory
    hidden: torch.Tensor  # (B, D)
    topk: torch.Tensor | None  # (n_full, B, K)
    write_slots: torch.Tensor  # (B,)
    copied: torch.cuda.Event  # the staging copy of the last replay: staging is rewritten only once it is done


class PagedDecoder:
    """Runs decode-only steps through `PagedDecodeBatch`: eagerly, or replaying CUDA graphs on CUDA."""

    def __init__(self, model: GlmMoeDsaForCausalLM, cache: PagedKVCache, block_size: int, use_cuda_graphs: bool = True,
                 stats: dict[str, float] | None = None, max_batch: int = BATCH_BUCKETS[-1],
                 fuse_pointwise: bool = False) -> None:
        """stats: where graph_captures and graph_capture_s (cumulative) are counted (the engine's stats). max_batch:
        the most sequences a step decodes; the first step at a block-table width captures every batch bucket up to it.
        fuse_pointwise: the model's enabled pointwise chains run compiled in these steps (models/fused_pointwise.py)."""
        self.model, self.cache, self.block_size = model, cache, block_size
        self.fuse_pointwise = fuse_pointwise
        self.batch_ladder = BATCH_BUCKETS[: bisect_left(BATCH_BUCKETS, min(max_batch, BATCH_BUCKETS[-1])) + 1]
        self.stats = stats if stats is not None else {}
        self.stats.setdefault("graph_captures", 0)
        self.stats.setdefault("graph_capture_s", 0.0)
        self.has_topk = len(model.config.full_layer_ids) > 0
        self.use_cuda_graphs = use_cuda_graphs and model.device.type == "cuda"
        if self.use_cuda_graphs and not model.graph_safe():
            # e.g. float32 weights on CUDA: the experts' loop reads per-expert counts on the host mid-forward.
            logger.info("engine: decode without CUDA graphs (%s experts sync with the host)", model.dtype)
            self.use_cuda_graphs = False
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = None
        self._tables: tuple[Hashable, np.ndarray, np.ndarray] | None = None  # (key, (n, width) table, row lengths)
        # The last step's device inputs, bucket, table width, rows and graph (None: eager): `forward_next` steps on.
        self._last: tuple[torch.Tensor, int, int, int, _Graph | None] | None = None
        self.sampling = SamplingGraphs(model.lm_head, model.config.vocab_size, self.stats)

    def reset(self) -> None:
        """Drop every captured graph (the weights or the KV pool moved)."""
        self._graphs.clear()
        self.sampling.reset()
        self._pool = None
        self._tables = None
        self._last = None

    def replays(self, n: int) -> bool:
        """Whether a step of n sequences runs from a CUDA graph."""
        return self.use_cuda_graphs and n <= BATCH_BUCKETS[-1]

    def samples_in_graph(self, n: int, padded_rows: int) -> bool:
        """Whether the last forward of n sequences (padded_rows: with its bucket's padding) ran from a CUDA graph and
        its sampling can too (`sample`)."""
        return self.replays(n) and self.sampling.fits(padded_rows)

    def sample(self, hidden: torch.Tensor, rows: SamplingRows, num_output: torch.Tensor,
               completers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The sampling of a replayed step from its padded hidden states (sample_graph.SamplingGraphs.run; None: sample
        eagerly)."""
        return self.sampling.run(hidden, rows, num_output, completers)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def forward(self, input_ids: list[int], positions: list[int], tables: list[list[int]],
                on_inputs: Callable[[torch.Tensor], None] | None = None,
                tables_key: Hashable = None,
                rows_from: tuple[Hashable, np.ndarray] | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """One token per sequence -> final hidden states of all rows of the batch's bucket (B_bucket, D), top-k of
        each full layer (n_full, B, K) or None, and the cache slot each new row went to (B,).

        `on_inputs` gets the device's input ids (B,) once they are queued, before the forward: the engine writes there
        the ids the host does not have yet (tokens an earlier step is still sampling on the device). `tables_key`
        (optional): equal keys promise the same block tables as the last call's, or the same ones grown at their ends;
        the host table is then updated, not rebuilt. `rows_from` (optional, with a new key): (the last call's key,
        each row's row in that call, all >= 0): the same promise row by row, when rows left or moved since."""
        n = len(input_ids)
        # Eager steps pad to the same buckets as graphs: with or without graphs, the same shapes, the same bits.
        B = BATCH_BUCKETS[bisect_left(BATCH_BUCKETS, n)] if n <= BATCH_BUCKETS[-1] else n
        width = 1 << (max(map(len, tables)) - 1).bit_length()
        if self.replays(n):
            try:
                hidden, topk, slots = self._replay(input_ids, positions, tables, B, width, on_inputs, tables_key,
                                                   rows_from)
                return hidden, topk, slots
            except RuntimeError:  # a failed capture leaves its memory pool unusable: no graphs from here on
                logger.exception("engine: CUDA graph capture failed; decoding eagerly from now on")
                self.use_cuda_graphs = False
                self.reset()
        inputs = torch.from_numpy(self._host_inputs(input_ids, positions, tables, B, width, tables_key, rows_from))
        if self.model.device.type == "cuda":
            inputs = inputs.pin_memory()
        inputs = inputs.to(self.model.device, non_blocking=True)
        if on_inputs is not None:
            on_inputs(inputs[:B])
        self._last = (inputs, B, width, n, None)
        hidden, topk, slots = self._run(inputs, B, width)
        return hidden, None if topk is None else topk[:, :n], slots[:n]

    def forward_next(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The step after the last `forward` (or `forward_next`) over the same rows, without the host: `tokens` (n,),
        the tokens that step sampled on the device, are the inputs, every position moves one on, the block tables stay
        (the caller gave each row its blocks for these positions). Returns as `forward` does."""
        if self._last is None:
            raise RuntimeError("forward_next needs a forward before it")
        inputs, B, width, n, graph = self._last
        inputs[:n].copy_(tokens[:n])
        inputs[B : B + n].add_(1)
        if graph is not None:
            graph.graph.replay()
            hidden, topk, slots = graph.hidden, graph.topk, graph.write_slots
        else:
            hidden, topk, slots = self._run(inputs, B, width)
        return hidden, None if topk is None else topk[:, :n], slots[:n]

    def _host_inputs(self, input_ids, positions, tables, B: int, width: int, tables_key: Hashable = None,
                     rows_from: tuple[Hashable, np.ndarray] | None = None) -> np.ndarray:
        """ids | positions | block table (B, width), padded with token 0 / position 0 / the scratch block."""
        flat = np.zeros(B * (2 + width), dtype=np.int64)
        n = len(input_ids)
        flat[:n] = input_ids
        flat[B : B + n] = positions
        table = flat[2 * B :].reshape(B, width)
        table[n:] = self.cache.scratch_block
        if n:
            table[:n] = self._block_table(tables, width, tables_key, rows_from)
        return flat

    def _block_table(self, tables: list[list[int]], width: int, key: Hashable,
                     rows_from: tuple[Hashable, np.ndarray] | None = None) -> np.ndarray:
        """(n, width) block ids, scratch-padded: the last call's table with the rows that grew extended when `key`
        matches its key, or its rows picked by `rows_from` and extended, else built in one scatter."""
        n = len(tables)
        lens = np.fromiter(map(len, tables), dtype=np.int64, count=n)
        last = self._tables
        table = None
        if key is not None and last is not None and last[1].shape[1] == width:
            if last[0] == key and last[1].shape[0] == n:
                table, before = last[1], last[2]
            elif rows_from is not None and rows_from[0] == last[0] and len(rows_from[1]) == n:
                table, before = last[1][rows_from[1]], last[2][rows_from[1]]  # copies: the last table stays whole
            if table is not None and not (lens >= before).all():
                table = None
        if table is not None:
            for r in np.flatnonzero(lens != before).tolist():
                table[r, before[r] : lens[r]] = tables[r][before[r] :]
        else:
            table = np.full((n, width), self.cache.scratch_block, dtype=np.int64)
            rows = np.repeat(np.arange(n), lens)
            cols = np.arange(len(rows)) - np.repeat(np.cumsum(lens) - lens, lens)
            table[rows, cols] = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=len(rows))
        self._tables = (key, table, lens) if key is not None else None
        return table

    def _run(self, inputs: torch.Tensor, B: int, width: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        ids, positions, table = inputs[:B], inputs[B : 2 * B], inputs[2 * B :].view(B, width)
        batch = PagedDecodeBatch(positions, table, self.block_size, self.cache)
        with fused_pointwise.fusing(self.fuse_pointwise):  # graphs and eager steps alike: the same bits
            out = self.model.forward_packed(ids, batch, return_logits=False, return_topk=self.has_topk)
        return out.hidden_states, out.topk_indices, batch.write_slots

    def _replay(self, input_ids, positions, tables, B: int, width: int, on_inputs, tables_key: Hashable = None,
                rows_from: tuple[Hashable, np.ndarray] | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        graph = self._graphs.get((B, width)) or self.capture_width(B, width)
        host = self._host_inputs(input_ids, positions, tables, B, width, tables_key, rows_from)
        graph.copied.synchronize()  # the host may run a step ahead of the device (the engine's overlap)
        graph.staging.numpy()[:] = host
        graph.inputs.copy_(graph.staging, non_blocking=True)
        graph.copied.record()
        if on_inputs is not None:
            on_inputs(graph.inputs[:B])
        graph.graph.replay()
        n = len(input_ids)
        self._last = (graph.inputs, B, width, n, graph)
        return graph.hidden, None if graph.topk is None else graph.topk[:, :n], graph.write_slots[:n]

    @torch.inference_mode()
    def capture_width(self, B: int, width: int) -> _Graph:
        """The graph of (B, width). At a width not seen before, the graphs of the whole batch ladder too: a step's
        batch shrinks as requests finish, and capturing each size when first met put captures in every early RL step.
        Largest first, so the shared memory pool grows once.

        In inference mode whoever calls it (the warm-up calls it outside a step): a capture under autograd keeps each
        graph's activations alive through its outputs' autograd graph, and replays the experts' training path."""
        new_width = all(w != width for _, w in self._graphs)
        for size in sorted({B, *self.batch_ladder}, reverse=True) if new_width else [B]:
            if (size, width) not in self._graphs:
                self._capture(size, width)
        return self._graphs[(B, width)]

    def _capture(self, B: int, width: int) -> _Graph:
        start = time.perf_counter()
        device = self.model.device
        inputs = torch.from_numpy(self._host_inputs([], [], [], B, width)).to(device)
        # Warm up on a side stream first: lazy initialisation and Triton autotuning must not be captured.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self._run(inputs, B, width)
        torch.cuda.current_stream(device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden, topk, write_slots = self._run(inputs, B, width)
        staging = torch.empty(inputs.shape, dtype=inputs.dtype).pin_memory()
        copied = torch.cuda.Event()
        copied.record()
        self._graphs[(B, width)] = captured = _Graph(graph, inputs, staging, hidden, topk, write_slots, copied)
        self.stats["graph_captures"] += 1
        self.stats["graph_capture_s"] += time.perf_counter() - start
        logger.info("engine: captured a CUDA graph for decode batch %d x %d blocks (%d graphs)", B, width, len(self._graphs))
        return captured
