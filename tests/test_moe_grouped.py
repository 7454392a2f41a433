"""The experts' grouped-GEMM inference path equals the per-expert loop, and follows weight updates."""

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


def test_autograd_uses_the_loop(moe):
    Experts.use_grouped_mm = None
    x = torch.randn(5, TINY["hidden_size"])
    moe(x).sum().backward()
    assert all(m.gate_proj.weight.grad is not None for m in moe.experts)  # every expert gets a grad
    assert moe.experts._stacked is None


def test_packed_batch_key_start_with_empty_sequences():
    cu_q = torch.tensor([0, 2, 2, 3])
    batch = PackedBatch(positions=torch.tensor([4, 5, 0]), cu_seqlens_q=cu_q, cu_seqlens_k=torch.tensor([0, 6, 9, 10]))
    assert batch.key_start.tolist() == [0, 0, 9]


def test_graph_safe_only_on_the_grouped_path():
    """CUDA-graph decode needs a forward with no host sync: the grouped path (CUDA bfloat16), never the loop."""
    model = GlmMoeDsaForCausalLM(ModelConfig.from_dict(dict(TINY)))
    assert not model.graph_safe()  # CPU float32: the loop path on CUDA-less training / float32 engines
    Experts.use_grouped_mm = True
    try:
        assert model.graph_safe()
    finally:
        Experts.use_grouped_mm = None
