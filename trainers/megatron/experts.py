"""Megatron's SequentialMLP experts (same modules, weights and names), computed on a GPU with two grouped GEMMs over
the stacked expert weights instead of one matmul per expert: what the local spec lacks without Transformer Engine's
grouped linear. Elsewhere (CPU, float32) it is megatron's own per-expert loop."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.moe.experts import SequentialMLP

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class GroupedSequentialMLP(SequentialMLP):
    """SequentialMLP whose forward is grouped GEMMs on CUDA in bfloat16 (expert tensor parallelism 1)."""

    def _grouped_ok(self, x: torch.Tensor) -> bool:
        fc1 = self.local_experts[0].linear_fc1.weight  # (2I, D)
        aligned = (fc1.shape[1] * x.element_size()) % 16 == 0 and (fc1.shape[0] // 2 * x.element_size()) % 16 == 0
        return (_grouped_mm is not None and x.is_cuda and x.dtype == torch.bfloat16 and aligned
                and not self.config.moe_apply_probs_on_input and self.num_local_experts > 1)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        x = permuted_local_hidden_states  # (N, D) rows sorted by local expert
        if not self._grouped_ok(x):
            return super().forward(x, tokens_per_expert, permuted_probs)
        w1 = torch.stack([e.linear_fc1.weight for e in self.local_experts])  # (E, 2I, D): gate rows, then up rows
        w2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])  # (E, D, I)
        offs = tokens_per_expert.to(x.device).cumsum(0).to(torch.int32)  # (E,) end row of each expert
        gate, up = _grouped_mm(x, w1.transpose(1, 2), offs=offs).chunk(2, dim=-1)  # (N, I) each
        h = (self.config.activation_func(gate) * up * permuted_probs.unsqueeze(-1)).to(x.dtype)
        return _grouped_mm(h, w2.transpose(1, 2), offs=offs), None  # (N, D)


def moe_spec(num_experts: int):
    """megatron's local MoE spec (router, shared expert) with GroupedSequentialMLP as the routed experts."""
    spec = get_moe_module_spec(use_te=False, num_experts=num_experts)
    submodules = spec.keywords["submodules"]
    submodules.experts = partial(GroupedSequentialMLP, submodules=submodules.experts.keywords["submodules"])
    return spec
