"""megatron's MLP and shared expert computing as GlmMoeDsa's MLP does at tensor parallel 1: gate and up as two GEMMs
over the halves of the fused fc1 weight (gate rows, then up rows; convert.py), not one GEMM of twice the width, and
all three through torch's linear (its backward, not megatron's linear function's). cuBLAS picks its kernel (tiling,
split-K) by shape, so the two can round differently in bf16; with tensor parallelism megatron's column- and
row-parallel layers stay (their shapes differ from FSDP2's anyway)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP


class SplitGluMLP(MLP):
    """megatron's MLP (gated, no bias); at TP 1: down(act(x gate^T) * (x up^T))."""

    split_gate_up = True  # False: megatron's one fc1 GEMM (benchmarks/megatron_layerwise.py compares the two)

    def _split(self, per_token_scale) -> bool:
        return (self.split_gate_up and self.config.tensor_model_parallel_size == 1 and self.config.gated_linear_unit
                and not self.config.add_bias_linear and per_token_scale is None
                and not self.config.use_te_activation_func and self.config.activation_func_clamp_value is None
                and not self.config.glu_linear_offset)

    def forward(self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None, **kwargs):
        """(.., D) -> (output (.., D), bias None), as MLP.forward."""
        if not self._split(per_token_scale):
            return super().forward(hidden_states, per_token_scale, **kwargs)
        gate, up = self.linear_fc1.weight.chunk(2)  # (I, D) each
        inner = self.config.activation_func(F.linear(hidden_states, gate)) * F.linear(hidden_states, up)
        return F.linear(inner, self.linear_fc2.weight), None  # torch's linear backward, as GlmMoeDsa's


class SplitGluSharedExpertMLP(SharedExpertMLP, SplitGluMLP):
    """megatron's shared expert whose MLP forward is SplitGluMLP's (the MRO puts it between the two)."""
