"""Triton kernels of the DSA ops (CUDA): the functions `slime_dsa.ops` dispatches to.

Same names, signatures and conventions as `slime_dsa/ops/reference.py`:
- `sparse_mla_attention`  triton_sparse_mla.py   MQA-mode sparse attention, forward + backward, decode split-K
- `indexer_topk`          triton_indexer.py      lightning-indexer scores + deterministic top-k (triton_topk.py)
- `indexer_topk_paged`    triton_indexer_paged.py the same at decode, keys read from a paged pool by slot
- `indexer_kl_loss`       triton_indexer_loss.py per-query KL(p_bar || softmax(I)) of an IndexShare group
"""

from __future__ import annotations

from slime_dsa.ops.triton_indexer import indexer_topk
from slime_dsa.ops.triton_indexer_loss import indexer_kl_loss
from slime_dsa.ops.triton_indexer_paged import indexer_topk_paged
from slime_dsa.ops.triton_sparse_mla import sparse_mla_attention

__all__ = ["sparse_mla_attention", "indexer_topk", "indexer_topk_paged", "indexer_kl_loss"]
