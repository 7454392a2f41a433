"""The experts' grouped-GEMM path equals the per-expert loop (inference and training), and follows weight updates."""

from __future__ import annotations

import pytest
import torch

from slime_dsa.models import GlmMoeDsaForCausalLM, ModelConfig, PackedBatch
from slime_dsa.models.glm_moe_dsa import Experts, MoE
from tests.hf_reference import TINY

pytestmark = pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"), reason="needs torch grouped_mm")


@pytest.fixture
def moe():
    torch.manual_seed(0)
    layer = MoE(ModelConfig.from_dict(dict(TINY)))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    yield layer
    Experts.use_grouped_mm = None


def _both(layer: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        Experts.use_grouped_mm = False
        loop = layer(x)
        Experts.use_grouped_mm = True
        grouped = layer(x)
    return loop, grouped


def test_grouped_equals_loop_and_follows_updates(moe):
    x = torch.randn(37, TINY["hidden_size"])
    loop, grouped = _both(moe, x)
    assert (loop - grouped).abs().max().item() <= 1e-5
    with torch.inference_mode():  # as Engine.update_weights writes: in place, one expert only
        moe.experts[5].down_proj.weight.copy_(torch.randn_like(moe.experts[5].down_proj.weight))
    loop2, grouped2 = _both(moe, x)
    assert (loop2 - loop).abs().max().item() > 1e-3  # the update matters ...
    assert (loop2 - grouped2).abs().max().item() <= 1e-5  # ... and the stacked copy followed it


def test_bf16_loop_rounds_as_the_grouped_path(moe):
    """In bf16 both paths weight each expert's output in float32, sum a token's k outputs in float32 and round once:
    equal but for float32 summation order (measured here: equal; on a larger layer 3e-5 of the elements one bf16 step
    apart). Summing in bf16, as the loop did, left 24% apart."""
    moe.to(torch.bfloat16)
    loop, grouped = _both(moe, torch.randn(300, TINY["hidden_size"], dtype=torch.bfloat16))
    assert loop.dtype == grouped.dtype == torch.bfloat16
    assert (loop != grouped).float().mean().item() <= 1e-3


def _grads(layer: MoE, x: torch.Tensor, grouped: bool | None) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    Experts.use_grouped_mm = grouped
    out = layer(x)
    (out.float() * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in layer.parameters()]


def test_training_grouped_equals_loop(moe):
    """Under autograd the grouped path stacks the live weights: same output and gradients as the loop, a gradient
    for every expert (hit or not, as FSDP needs), and no stacked copy kept."""
    x = torch.randn(23, TINY["hidden_size"])
    out_loop, dx_loop, grads_loop = _grads(moe, x, grouped=False)
    out_grouped, dx_grouped, grads_grouped = _grads(moe, x, grouped=True)
    assert (out_loop - out_grouped).abs().max().item() <= 1e-5
    assert (dx_loop - dx_grouped).abs().max().item() <= 1e-5
    for a, b in zip(grads_loop, grads_grouped):
        assert (a - b).abs().max().item() <= 1e-5
    assert all(m.gate_proj.weight.grad is not None for m in moe.experts)
    assert moe.experts._stacked is None


def test_cpu_float32_training_takes_the_grouped_path(moe, monkeypatch):
    Experts.use_grouped_mm = None
    monkeypatch.setattr(Experts, "_grouped_failed", False)
    calls = []
    monkeypatch.setattr(Experts, "_forward_loop", lambda self, *a: calls.append("loop"))
    moe(torch.randn(5, TINY["hidden_size"])).sum().backward()
    assert calls == []  # the loop never ran: CPU float32 under autograd is grouped
    assert moe.experts._stacked is None


def test_packed_batch_key_start_with_empty_sequences():
    cu_q = torch.tensor([0, 2, 2, 3])
    batch = PackedBatch(positions=torch.tensor([4, 5, 0]), cu_seqlens_q=cu_q, cu_seqlens_k=torch.tensor([0, 6, 9, 10]))
    assert batch.key_start.tolist() == [0, 0, 9]


def test_graph_safe_only_on_the_grouped_path():
    """CUDA-graph decode needs a forward with no host sync: the grouped path (CUDA bfloat16), never the loop."""
    model = GlmMoeDsaForCausalLM(ModelConfig.from_dict(dict(TINY)))
    assert not model.graph_safe()  # CPU: no CUDA graphs whatever the path
    Experts.use_grouped_mm = True
    try:
        assert model.graph_safe()
    finally:
        Experts.use_grouped_mm = None


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16-weights", "fp32-weights-autocast"])
def test_cuda_training_grouped_matches_loop(autocast):
    """On CUDA, training takes the grouped path in bf16 (FSDP2 mixed precision) and under bf16 autocast (SFT):
    output and gradients match the per-expert loop's up to bf16 rounding."""
    torch.manual_seed(0)
    layer = MoE(ModelConfig.from_dict(dict(TINY))).cuda()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    if not autocast:
        layer = layer.to(torch.bfloat16)
    x = torch.randn(300, TINY["hidden_size"], device="cuda", dtype=torch.float32 if autocast else torch.bfloat16)
    results = {}
    for path, grouped in (("loop", False), ("grouped", None)):  # None: the automatic choice must be grouped
        calls = []
        original = Experts._forward_loop
        Experts._forward_loop = lambda self, *a, _o=original: calls.append(1) or _o(self, *a)
        try:
            Experts.use_grouped_mm = grouped
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                results[path] = _grads(layer, x, grouped)
        finally:
            Experts._forward_loop = original
            Experts.use_grouped_mm = None
        assert bool(calls) == (path == "loop")
    (out_l, dx_l, g_l), (out_g, dx_g, g_g) = results["loop"], results["grouped"]
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()  # noqa: E731
    assert rel(out_g, out_l) <= 2e-2 and rel(dx_g, dx_l) <= 2e-2
    assert all(rel(a, b) <= 2e-2 for a, b in zip(g_g, g_l))


def test_rows_off_16_byte_boundaries_take_the_loop_without_disabling_grouped(monkeypatch):
    """grouped_mm needs 16-byte aligned rows: an odd hidden size takes the loop, and other models keep grouped."""
    monkeypatch.setattr(Experts, "_grouped_failed", False)
    odd = MoE(ModelConfig.from_dict({**TINY, "hidden_size": 30}))
    assert not odd.experts._grouped_ok(torch.randn(3, 30))
    odd(torch.randn(3, 30, requires_grad=True)).sum().backward()
    assert not Experts._grouped_failed
    assert MoE(ModelConfig.from_dict(dict(TINY))).experts._grouped_ok(torch.randn(3, TINY["hidden_size"]))


def test_running_out_of_memory_in_the_grouped_path_raises_and_keeps_it(moe, monkeypatch):
    """An out-of-memory error in grouped_mm is the device's state, not a missing kernel: it reaches the caller, and
    the process keeps the grouped path (a full GPU during an engine's warm-up once switched it to the per-expert loop
    for good, and with it off CUDA graphs)."""
    Experts.use_grouped_mm = None
    monkeypatch.setattr(Experts, "_grouped_failed", False)

    def out_of_memory(self, *args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.00 MiB.")

    monkeypatch.setattr(Experts, "_forward_grouped", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        moe(torch.randn(5, TINY["hidden_size"]))
    assert not Experts._grouped_failed
