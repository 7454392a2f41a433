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

With `index_key_dtype` float8_e4m3fn the indexer keys are kept in FP8 with a float32 scale per row (the layout of
`slime_dsa/ops/fp8_keys.py`, as DeepSeek's and SGLang's DSA caches keep them): half the bytes the decode indexer reads.
`update` then returns them as `Fp8Keys`, and a prefill scores the same quantized keys that its decode steps will.

With `keep_topk`, a third pool keeps each row's DSA selection (n_full, slots, index_topk): the engine stores it
after the forward (`store_topk`), so a request can read the selection of prompt rows another request computed
(a reused prefix) for exact index replay. int16 while every position fits (context <= 32768), else int32.
"""

from __future__ import annotations

import math

import torch

from slime_dsa.models import ModelConfig
from slime_dsa.ops.fp8_keys import FP8_DTYPE, Fp8Keys, quantize_keys


class PagedKVCache:
    """Latent KV rows (L, slots, Dl+Dr) and indexer keys (n_full, slots, Di), allocated once."""

    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str,
        keep_topk: bool = False, index_key_dtype: torch.dtype | None = None,
    ) -> None:
        """index_key_dtype: the indexer keys' dtype, `dtype` by default; float8_e4m3fn keeps them in FP8 with scales."""
        if index_key_dtype not in (None, dtype, FP8_DTYPE):
            raise ValueError(f"PagedKVCache: index_key_dtype must be the cache dtype or {FP8_DTYPE}, got {index_key_dtype}")
        self.index_key_dtype = index_key_dtype or dtype
        self.fp8_index_keys = self.index_key_dtype == FP8_DTYPE
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch_block = num_blocks
        num_slots = (num_blocks + 1) * block_size
        self.full_index = {layer: i for i, layer in enumerate(config.full_layer_ids)}
        self._shapes = {
            "kv": (config.num_hidden_layers, num_slots, config.kv_lora_rank + config.qk_rope_head_dim),
            "index_k": (len(self.full_index), num_slots, config.index_head_dim),
        }
        self._scale_shape = (len(self.full_index), num_slots) if self.fp8_index_keys else (0,)
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
        self.index_k = torch.zeros(self._shapes["index_k"], dtype=self.index_key_dtype, device=self.device)
        self.index_k_scale = torch.zeros(self._scale_shape, dtype=torch.float32, device=self.device)
        shape = self._topk_shape if self.keep_topk else (0,)
        self.topk = torch.full(shape, -1, dtype=self._topk_dtype, device=self.device)

    def release(self) -> None:
        """Drop the pools (colocated training needs the memory); allocate() brings them back."""
        self.kv = torch.empty(0, dtype=self.dtype, device=self.device)
        self.index_k = torch.empty(0, dtype=self.index_key_dtype, device=self.device)
        self.index_k_scale = torch.empty(0, dtype=torch.float32, device=self.device)
        self.topk = torch.empty(0, dtype=self._topk_dtype, device=self.device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv, self.index_k, self.index_k_scale, self.topk))

    @property
    def pool_nbytes(self) -> int:
        """The pools' size when allocated (nbytes is 0 while released)."""
        rows = math.prod(self._shapes["kv"]) * _itemsize(self.dtype)
        rows += math.prod(self._shapes["index_k"]) * _itemsize(self.index_key_dtype) + math.prod(self._scale_shape) * 4
        topk = math.prod(self._topk_shape) * _itemsize(self._topk_dtype) if self.keep_topk else 0
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
        index_bytes = self.index_k.view(torch.uint8)  # FP8 has no index_copy_ kernel: copied as bytes
        index_bytes.index_copy_(1, dst, index_bytes.index_select(1, src))
        if self.fp8_index_keys:
            self.index_k_scale.index_copy_(1, dst, self.index_k_scale.index_select(1, src))
        if self.keep_topk:
            self.topk.index_copy_(1, dst, self.topk.index_select(1, src))

    def update(self, layer_idx: int, kv: torch.Tensor, index_k: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor | Fp8Keys | None]:
        """Store this step's rows kv (Tq, Dl+Dr) / index_k (Tq, Di); return every key row of the batch (Tk, ...)."""
        pool = self.kv[layer_idx]
        pool.index_copy_(0, self._write, kv.to(pool.dtype))
        keys = pool if self._read_pool else kv if self._read is None else pool.index_select(0, self._read)
        if index_k is None:
            return keys, None
        layer = self.full_index[layer_idx]
        if self.fp8_index_keys:
            return keys, self._update_fp8_keys(layer, index_k)
        index_pool = self.index_k[layer]
        index_pool.index_copy_(0, self._write, index_k.to(index_pool.dtype))
        if self._read_pool:
            return keys, index_pool
        index_keys = index_k if self._read is None else index_pool.index_select(0, self._read)
        return keys, index_keys

    def _update_fp8_keys(self, layer: int, index_k: torch.Tensor) -> Fp8Keys:
        """Quantize and store the new index keys; the batch's key rows as `update` returns them, in FP8."""
        new = quantize_keys(index_k)
        pool = Fp8Keys(self.index_k[layer], self.index_k_scale[layer])
        pool.values.view(torch.uint8).index_copy_(0, self._write, new.values.view(torch.uint8))
        pool.scales.index_copy_(0, self._write, new.scales)
        if self._read_pool:
            return pool
        return new if self._read is None else pool.rows(self._read)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()
