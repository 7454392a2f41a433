"""Paged MLA KV cache: pre-allocated per-layer pools of latent rows, and indexer keys for full layers.

Only what absorbed MLA attends to is cached: per layer the row cat(c_kv, k_rope) (kv_lora_rank +
qk_rope_head_dim), and for each `full` (indexer) layer the indexer key (index_head_dim). Per-head K/V are
never expanded. A slot is one token row: slot = block * block_size + offset.

Implements the model's `KVCache` protocol for one forward at a time: `bind()` gives the step's slot mapping
(where each new row goes, where each key row of the batch lives), then the model calls `update()` once per
layer, which writes the new rows first and then gathers the keys, so a sequence may read rows another
sequence of the same batch writes in that very forward (prefix sharing between requests admitted together).
`bind_pool()` is the decode variant: attention reads the whole pool through slot numbers, nothing is gathered.

One extra block past `num_blocks`, the scratch block, is never handed out: padded rows of a CUDA-graph
decode batch write there and unused block-table entries point there.

With `keep_topk`, a third pool keeps each row's DSA selection (n_full, slots, index_topk): the engine stores it
after the forward (`store_topk`), so a request can read the selection of prompt rows another request computed
(a reused prefix) for exact index replay. int16 while every position fits (context <= 32768), else int32.
"""

from __future__ import annotations

import math

import torch

from slime_dsa.models import ModelConfig


class PagedKVCache:
    """Latent KV rows (L, slots, Dl+Dr) and indexer keys (n_full, slots, Di), allocated once."""

    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str,
        keep_topk: bool = False,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch_block = num_blocks
        num_slots = (num_blocks + 1) * block_size
        self.full_index = {layer: i for i, layer in enumerate(config.full_layer_ids)}
        self._shapes = {
            "kv": (config.num_hidden_layers, num_slots, config.kv_lora_rank + config.qk_rope_head_dim),
            "index_k": (len(self.full_index), num_slots, config.index_head_dim),
        }
        self.keep_topk = keep_topk
        self._topk_shape = (len(self.full_index), num_slots, config.index_topk)
        self._topk_dtype = torch.int16 if config.max_position_embeddings <= 2**15 else torch.int32
        self.dtype, self.device = dtype, device
        self.allocate()
        self._write: torch.Tensor | None = None
        self._read: torch.Tensor | None = None
        self._read_pool = False

    def allocate(self) -> None:
        """(Re)create the pools, zeroed."""
        self.kv = torch.zeros(self._shapes["kv"], dtype=self.dtype, device=self.device)
        self.index_k = torch.zeros(self._shapes["index_k"], dtype=self.dtype, device=self.device)
        shape = self._topk_shape if self.keep_topk else (0,)
        self.topk = torch.full(shape, -1, dtype=self._topk_dtype, device=self.device)

    def release(self) -> None:
        """Drop the pools (colocated training needs the memory); allocate() brings them back."""
        self.kv = self.index_k = torch.empty(0, dtype=self.dtype, device=self.device)
        self.topk = torch.empty(0, dtype=self._topk_dtype, device=self.device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv, self.index_k, self.topk))

    @property
    def pool_nbytes(self) -> int:
        """The pools' size when allocated (nbytes is 0 while released)."""
        item = torch.empty(0, dtype=self.dtype).element_size()
        rows = sum(math.prod(shape) for shape in self._shapes.values()) * item
        topk = math.prod(self._topk_shape) * torch.empty(0, dtype=self._topk_dtype).element_size() if self.keep_topk else 0
        return rows + topk

    def store_topk(self, slots: torch.Tensor, local: torch.Tensor) -> None:
        """Keep this step's selections (n_full, Tq, K), sequence-local, at the rows' slots (Tq,)."""
        self.topk.index_copy_(1, slots, local.to(self.topk.dtype))

    def read_topk(self, slots: torch.Tensor) -> torch.Tensor:
        """The kept selections of `slots` (S,) as (S, n_full, K) int32, contiguous: each slot's rows in one block."""
        rows = self.topk.index_select(1, slots)  # (n_full, S, K)
        out = torch.empty((rows.shape[1], rows.shape[0], rows.shape[2]), dtype=torch.int32, device=rows.device)
        return out.copy_(rows.transpose(0, 1))  # the cast and the transpose in one pass

    def bind(self, write_slots: torch.Tensor, read_slots: torch.Tensor | None) -> "PagedKVCache":
        """Slot of each new row (Tq,), and of each key row in cu_seqlens_k layout (Tk,) or None when keys == new rows."""
        self._write, self._read, self._read_pool = write_slots, read_slots, False
        return self

    def bind_pool(self, write_slots: torch.Tensor) -> "PagedKVCache":
        """Slot of each new row (Tq,); `update` then returns the whole pool layer, indexed by slot."""
        self._write, self._read, self._read_pool = write_slots, None, True
        return self

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots src -> dst in every layer's pools (a request forked from another with the same prompt)."""
        self.kv.index_copy_(1, dst, self.kv.index_select(1, src))
        self.index_k.index_copy_(1, dst, self.index_k.index_select(1, src))
        if self.keep_topk:
            self.topk.index_copy_(1, dst, self.topk.index_select(1, src))

    def update(self, layer_idx: int, kv: torch.Tensor, index_k: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Store this step's rows kv (Tq, Dl+Dr) / index_k (Tq, Di); return every key row of the batch (Tk, ...)."""
        pool = self.kv[layer_idx]
        pool.index_copy_(0, self._write, kv.to(pool.dtype))
        keys = pool if self._read_pool else kv if self._read is None else pool.index_select(0, self._read)
        if index_k is None:
            return keys, None
        index_pool = self.index_k[self.full_index[layer_idx]]
        index_pool.index_copy_(0, self._write, index_k.to(index_pool.dtype))
        if self._read_pool:
            return keys, index_pool
        index_keys = index_k if self._read is None else index_pool.index_select(0, self._read)
        return keys, index_keys
