"""Small Triton kernels that run one jitted helper of slime_dsa/ops for tests/interpret_checks.py (imported there after
TRITON_INTERPRET=1 is set, like the kernel modules)."""

from __future__ import annotations

import triton
import triton.language as tl

from slime_dsa.ops.triton_sparse_mla_fwd_variants import _idx_slice


@triton.jit
def idx_slice_probe(idx_ptr, out_ptr, n0, k_lo, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out = _idx_slice of the (BLOCK_K,) index range at idx_ptr for the step at slot n0."""
    idx_all = tl.load(idx_ptr + tl.arange(0, BLOCK_K))
    tl.store(out_ptr + tl.arange(0, BLOCK_N), _idx_slice(idx_all, n0, k_lo, BLOCK_N, BLOCK_K))
