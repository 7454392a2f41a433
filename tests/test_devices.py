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


def test_packed_bytes_read_back_as_the_tensors_they_were():
    """upload_many's one buffer (slime_dsa.devices.pack_bytes / unpack_bytes): every dtype and shape, 0-dim, empty and
    non-contiguous tensors come back equal, each view 16-byte aligned in the buffer."""
    from slime_dsa.devices import pack_bytes, unpack_bytes

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=g), torch.arange(7), torch.tensor(2.5, dtype=torch.float64),
               torch.rand(4, generator=g) > 0.5, torch.randn(2, 3, generator=g).bfloat16(), torch.empty(0, 4),
               torch.randint(0, 9, (3,), dtype=torch.int32), torch.randn(4, 6, generator=g).t()]
    buffer, offsets = pack_bytes(tensors)
    assert buffer.dtype == torch.uint8 and all(o % 16 == 0 for o in offsets)
    back = unpack_bytes(buffer, tensors, offsets)
    for original, copy in zip(tensors, back):
        assert copy.dtype == original.dtype and copy.shape == original.shape and torch.equal(copy, original)


def test_upload_many_on_the_host_is_upload():
    from slime_dsa.devices import upload_many

    x, y = torch.arange(3), torch.ones(2)
    assert upload_many([x, None, y], "cpu") == [x, None, y]


@pytest.mark.gpu
def test_upload_many_sends_host_tensors_in_one_copy_without_waiting():
    from slime_dsa.devices import upload_many

    g = torch.Generator().manual_seed(0)
    host = [torch.randn(1000, generator=g), None, torch.arange(5), torch.rand(3, generator=g) > 0.5]
    already = torch.ones(2, device="cuda")
    busy = torch.randn(4096, 4096, device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
        try:
            for _ in range(4):
                busy = busy @ busy  # queued work the host must not wait for
            out = upload_many([*host, already], "cuda")
        finally:
            torch.cuda.set_sync_debug_mode(0)
    copies = [e for e in prof.events() if "memcpy" in e.name.lower() and "htod" in e.name.lower()]
    assert len(copies) == 1, [e.name for e in copies]
    assert out[1] is None and out[4] is already
    for original, arrived in zip(host, out):
        assert original is None or (arrived.is_cuda and torch.equal(arrived.cpu(), original))
