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


class _FakeGluon:
    """FAKE Gluon module (its kernels run only on sm_90): records the calls the dispatcher routes to it."""

    def __init__(self):
        self.calls = []

    def supported(self, *args) -> bool:
        return True

    def sparse_mla_fwd(self, q, kv, indices, scale, v_dim):
        self.calls.append("fwd")
        return torch.full((*q.shape[:2], v_dim), 2.0, dtype=q.dtype), torch.zeros(q.shape[:2])

    def sparse_mla_bwd(self, q, kv, indices, dout, lse, delta, scale, dq, dkv):
        self.calls.append(("bwd", dq is not None, dkv is not None))
        dq.fill_(3.0)
        dkv.fill_(4.0)


def test_gluon_switches_route_prefill_forward_and_general_backward(monkeypatch):
    pytest.importorskip("triton")
    from slime_dsa.ops import triton_sparse_mla as mla

    fake = _FakeGluon()
    monkeypatch.setattr(mla, "_gluon_module", lambda name: fake)
    monkeypatch.setattr(mla, "USE_KEY_RANGES", False)
    q, kv, _, dout, _, _ = _inputs(T=300, Tk=300, K=64)
    indices = torch.randint(0, 300, (300, 64))
    assert mla._forward_variant(False, 300, 64, 64, q.dtype, 576, 512, q.device) is not None  # a prefill-shaped call
    monkeypatch.setattr(mla, "GLUON_FWD", True)
    monkeypatch.setattr(mla, "GLUON_BWD", True)
    out, lse = mla.sparse_mla_fwd(q, kv, indices, 0.1, 512)
    dq, dkv = mla.sparse_mla_bwd(q, kv, indices, out, lse, dout, None, 0.1, 512)
    assert fake.calls == ["fwd", ("bwd", True, True)]
    assert bool((out == 2).all() and (dq == 3).all() and (dkv == 4).all()) and dkv.dtype == kv.dtype
    # the invariant forward never leaves its own kernel
    assert mla._forward_variant(True, 300, 64, 64, q.dtype, 576, 512, q.device) is None


def test_decode_rows_that_fill_a_wave_take_the_gluon_forward(monkeypatch):
    """Decode rows (the Triton forward would split their keys) go to the unsplit Gluon forward once they fill about
    one wave of programs; fewer rows, the invariant forward and a forced Triton variant stay on the Triton kernels."""
    pytest.importorskip("triton")
    from slime_dsa.ops import triton_sparse_mla as mla

    fake = _FakeGluon()
    monkeypatch.setattr(mla, "_gluon_module", lambda name: fake)
    monkeypatch.setattr(mla, "_num_sms", lambda device: 132)
    monkeypatch.setattr(mla, "GLUON_FWD", True)
    q, kv, _, _, _, _ = _inputs(T=128, Tk=4096, K=2048)
    indices = torch.randint(0, 4096, (128, 2048))
    assert mla._forward_variant(False, 128, 64, 2048, q.dtype, 576, 512, q.device) is None  # split by keys in Triton
    out, _ = mla.sparse_mla_fwd(q, kv, indices, 0.1, 512)
    assert fake.calls == ["fwd"] and bool((out == 2).all())
    assert mla._fills_a_wave_unsplit(False, 128, 64, q.device)
    assert not mla._fills_a_wave_unsplit(False, 64, 64, q.device)  # half the SMs: the split kernel
    assert not mla._fills_a_wave_unsplit(True, 128, 64, q.device)  # batch-invariant: never by row count
    monkeypatch.setattr(mla, "FWD_VARIANT", mla.PLAIN_FWD)
    assert not mla._fills_a_wave_unsplit(False, 128, 64, q.device)
