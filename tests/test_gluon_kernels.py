"""The Gluon kernels' host-side checks on CPU (the kernels themselves run only on sm_90: tests/test_ops_gpu.py)."""

from __future__ import annotations

import pytest
import torch


def _inputs(T: int = 2, H: int = 64, Tk: int = 5, K: int = 4):
    bf16 = torch.bfloat16
    q, kv = torch.zeros(T, H, 576, dtype=bf16), torch.zeros(Tk, 576, dtype=bf16)
    indices, dout = torch.zeros(T, K, dtype=torch.int64), torch.zeros(T, H, 512, dtype=bf16)
    return q, kv, indices, dout, torch.zeros(T, H), torch.zeros(T, H)


def test_gluon_kernels_are_not_supported_off_the_gpu():
    gluon_fwd = pytest.importorskip("slime_dsa.ops.gluon_sparse_mla", exc_type=ImportError)
    gluon_bwd = pytest.importorskip("slime_dsa.ops.gluon_sparse_mla_bwd", exc_type=ImportError)
    q, kv, indices, dout, _, _ = _inputs()
    assert not gluon_fwd.supported(q, kv, indices, 512)
    assert not gluon_bwd.supported(q, kv, indices, dout, 512)


def test_gluon_backward_refuses_gradient_buffers_it_cannot_write():
    gluon_bwd = pytest.importorskip("slime_dsa.ops.gluon_sparse_mla_bwd", exc_type=ImportError)
    q, kv, indices, dout, lse, delta = _inputs()
    bad = {"bf16 dkv": (None, torch.zeros(kv.shape, dtype=torch.bfloat16)),
           "dkv of another shape": (None, torch.zeros(6, 576)),
           "strided dq": (torch.zeros(2, 576, 64, dtype=torch.bfloat16).transpose(1, 2), None)}
    for name, (dq, dkv) in bad.items():
        with pytest.raises(ValueError, match="dq must be like q and dkv float32"):
            gluon_bwd.sparse_mla_bwd(q, kv, indices, dout, lse, delta, 0.1, dq, dkv)
