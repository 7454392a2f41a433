"""Gradient sums in foreach calls (trainers/grad_sums.py): one call per dtype pair, so CUDA's fused kernels take
the bf16 gradients while the float32 routers' go in their own call (a mixed list falls to one launch per tensor)."""

from __future__ import annotations

import torch

from trainers.grad_sums import add_gradients


def test_sums_copy_then_add_one_foreach_call_per_dtype_pair(monkeypatch):
    calls = []
    for name in ("_foreach_copy_", "_foreach_add_"):
        real = getattr(torch, name)

        def record(sums, grads, _real=real, _name=name):
            calls.append((_name, {s.dtype for s in sums}, {g.dtype for g in grads}, len(sums)))
            return _real(sums, grads)

        monkeypatch.setattr(torch, name, record)
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(3, generator=g).to(dtype) for dtype in (torch.bfloat16, torch.float32, torch.bfloat16)]
    sums = [torch.zeros(3) for _ in grads]
    add_gradients(list(zip(sums, grads)), [])
    add_gradients([], list(zip(sums, grads)))
    assert sorted(calls, key=str) == sorted([
        ("_foreach_copy_", {torch.float32}, {torch.bfloat16}, 2), ("_foreach_copy_", {torch.float32}, {torch.float32}, 1),
        ("_foreach_add_", {torch.float32}, {torch.bfloat16}, 2), ("_foreach_add_", {torch.float32}, {torch.float32}, 1),
    ], key=str)
    for total, grad in zip(sums, grads):
        assert torch.equal(total, 2 * grad.float())  # bf16 widens exactly
