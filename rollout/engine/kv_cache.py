"""Paged MLA KV cache: pre-allocated per-layer pools of latent rows, and indexer keys for full layers.

Only what absorbed MLA attends to is cached: per layer the row cat(c_kv, k_rope) (kv_lora_rank +
qk_rope_head_dim), and for each `full` (indexer) layer the indexer key (index_head_dim). Per-head K/V are
never expanded. A slot is one token row: slot = block * block_size + offset.

Implements the model's `KVCache` protocol for one forward at a time: `bind()` gives the step's slot mapping
(where each new row goes, where each key row of the batch lives), then the model calls `update()` once per
layer, which writes the new rows first and then gathers the keys, so a sequence may read rows another
sequence of the same batch writes in that very forward (prefix sharing between requests admitted together).
"""

from __future__ import annotations

import torch

from slime_dsa.models import ModelConfig


class PagedKVCache:
    """Latent KV rows (L, slots, Dl+Dr) and indexer keys (n_full, slots, Di), allocated once."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        num_slots = num_blocks * block_size
        self.full_index = {layer: i for i, layer in enumerate(config.full_layer_ids)}
        self._shapes = {
            "kv": (config.num_hidden_layers, num_slots, config.kv_lora_rank + config.qk_rope_head_dim),
            "index_k": (len(self.full_index), num_slots, config.index_head_dim),
        }
        self.dtype, self.device = dtype, device
        self.allocate()
        self._write: torch.Tensor | None = None
        self._read: torch.Tensor | None = None

    def allocate(self) -> None:
        """(Re)create the pools, zeroed."""
        self.kv = torch.zeros(self._shapes["kv"], dtype=self.dtype, device=self.device)
        self.index_k = torch.zeros(self._shapes["index_k"], dtype=self.dtype, device=self.device)

    def release(self) -> None:
        """Drop the pools (colocated training needs the memory); allocate() brings them back."""
        self.kv = self.index_k = torch.empty(0, dtype=self.dtype, device=self.device)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + self.index_k.numel() * self.index_k.element_size()

    def bind(self, write_slots: torch.Tensor, read_slots: torch.Tensor | None) -> "PagedKVCache":
        """Slot of each new row (Tq,), and of each key row in cu_seqlens_k layout (Tk,) or None when keys == new rows."""
        self._write, self._read = write_slots, read_slots
        return self

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots src -> dst in every layer's pools (a request forked from another with the same prompt)."""
        self.kv.index_copy_(1, dst, self.kv.index_select(1, src))
        self.index_k.index_copy_(1, dst, self.index_k.index_select(1, src))

    def update(self, layer_idx: int, kv: torch.Tensor, index_k: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Store this step's rows kv (Tq, Dl+Dr) / index_k (Tq, Di); return every key row of the batch (Tk, ...)."""
        pool = self.kv[layer_idx]
        pool.index_copy_(0, self._write, kv.to(pool.dtype))
        keys = kv if self._read is None else pool.index_select(0, self._read)
        if index_k is None:
            return keys, None
        index_pool = self.index_k[self.full_index[layer_idx]]
        index_pool.index_copy_(0, self._write, index_k.to(index_pool.dtype))
        index_keys = index_k if self._read is None else index_pool.index_select(0, self._read)
        return keys, index_keys
