"""Host tensors reach the GPU without making the host wait (slime_dsa/devices.py), and packing sizes need no sync."""

from __future__ import annotations

import pytest
import torch

from slime_dsa.devices import upload
from slime_dsa.models import PackedBatch


def test_upload_on_the_host_is_a_plain_move():
    x = torch.arange(6)
    assert upload(x, "cpu") is x
    assert torch.equal(PackedBatch.from_seqlens([2, 3, 1]).positions, torch.tensor([0, 1, 0, 1, 2, 0]))


@pytest.mark.gpu
def test_upload_and_packing_do_not_wait_for_the_gpu():
    x = torch.randn(4096)
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
    try:
        for _ in range(4):
            busy = busy @ busy  # queued work the host must not wait for
        y = upload(x, "cuda")
        packed = PackedBatch.from_seqlens([3, 5, 2], "cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(y.cpu(), x)
    assert packed.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]


def test_foreach_copy_equals_copy_and_calls_foreach_once_per_dtype_pair(monkeypatch):
    from slime_dsa.devices import foreach_copy

    g = torch.Generator().manual_seed(0)
    pairs = [(torch.empty(3, dtype=dst), torch.randn(3, generator=g).to(src))
             for dst, src in [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                              (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                              (torch.float32, torch.bfloat16)]]
    expected = [torch.empty_like(d).copy_(s) for d, s in pairs]
    calls = []
    inner = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda ds, ss: (calls.append(len(ds)), inner(ds, ss)))
    foreach_copy([d for d, _ in pairs], [s for _, s in pairs])
    assert all(torch.equal(d, e) for (d, _), e in zip(pairs, expected))
    assert sorted(calls) == [1, 1, 1, 2]  # four (destination, source) dtype pairs, bf16 <- fp32 twice
    with pytest.raises(ValueError):
        foreach_copy([torch.empty(1)], [])
