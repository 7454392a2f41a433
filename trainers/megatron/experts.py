"""Megatron's MoE layer and SequentialMLP experts (same modules, weights and names), computing as GlmMoeDsa's MoE,
forward and backward, so that bf16 rounds alike (one rounding difference can flip later layers' expert choices):
- the router: its logits through torch's linear, GlmMoeDsa's top-k (slime_dsa.models.glm_moe_dsa.route: weights
  normalised in ascending expert order; megatron's normalises in top-k order);
- the rows gathered by advanced indexing (megatron's index_select adds a token's k row gradients with bf16 atomics);
- each routed expert's output weighted by its routing probability in float32, put back in token order by
  index_copy_ (the rows are a permutation: its backward is a gather, where index_select's is an index_add_), a
  token's k weighted outputs summed in float32 in ascending expert order and rounded once to the layer's dtype
  (megatron's scales before fc2 and sums in bf16 with scatter_add_, on a GPU atomics in no fixed order);
- router, routed experts, then the shared expert (gate and up as two GEMMs: mlp.py), in that order: autograd sums
  the layer input's gradients in reverse order of use (megatron runs the shared expert first).
On a GPU in bf16 the experts run as two grouped GEMMs over the stacked expert weights, the same kernel calls as
GlmMoeDsa's grouped path (the local spec has no grouped linear without Transformer Engine); elsewhere megatron's
per-expert loop. When a rank holds every expert (expert parallel 1), the dispatch keeps its counts on the device:
megatron's copies them to the host, a stall in every MoE layer's forward. benchmarks/megatron_layerwise.py switches
each of these back to megatron's own (the class attributes below) to measure what it changes."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, get_default_pg_collection
from megatron.core.transformer.moe.moe_utils import permute
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from slime_dsa.models.glm_moe_dsa import route
from trainers.megatron.mlp import SplitGluSharedExpertMLP

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class GroupedSequentialMLP(SequentialMLP):
    """SequentialMLP returning float32 prob-weighted rows; grouped GEMMs on CUDA in bfloat16 (expert TP 1)."""

    use_grouped_mm: bool | None = None  # None: on CUDA in bf16; True forces it (as GlmMoeDsa's Experts.use_grouped_mm)

    def _grouped_ok(self, x: torch.Tensor) -> bool:
        if self.use_grouped_mm is not None:
            return self.use_grouped_mm and _grouped_mm is not None
        fc1 = self.local_experts[0].linear_fc1.weight  # (2I, D)
        aligned = (fc1.shape[1] * x.element_size()) % 16 == 0 and (fc1.shape[0] // 2 * x.element_size()) % 16 == 0
        return (_grouped_mm is not None and x.is_cuda and x.dtype == torch.bfloat16 and aligned
                and self.num_local_experts > 1)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """x (N, D) rows sorted by local expert, probs (N,) -> (prob x expert(x) (N, D) float32, None)."""
        if self.config.moe_apply_probs_on_input:
            raise ValueError("moe_apply_probs_on_input is not built for GroupedSequentialMLP")
        x = permuted_local_hidden_states
        if self._grouped_ok(x):
            y = self._grouped(x, tokens_per_expert)
        else:  # megatron's loop, unweighted (a scale of 1 is exact)
            y, _ = super().forward(x, tokens_per_expert, torch.ones_like(permuted_probs))
        return y * permuted_probs.float().unsqueeze(-1), None  # float32, as GlmMoeDsa's Experts

    def _grouped(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1 = torch.stack([e.linear_fc1.weight for e in self.local_experts])  # (E, 2I, D): gate rows, then up rows
        w2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])  # (E, D, I)
        offs = tokens_per_expert.to(x.device).cumsum(0).to(torch.int32)  # (E,) end row of each expert
        gate, up = _grouped_mm(x, w1.transpose(1, 2), offs=offs).chunk(2, dim=-1)  # (N, I) each
        return _grouped_mm(self.config.activation_func(gate) * up, w2.transpose(1, 2), offs=offs)  # (N, D)


class LocalExpertsDispatcher(MoEAllGatherTokenDispatcher):
    """The allgather dispatcher without host syncs when this rank holds every expert: each token then goes to exactly
    top-k local experts, so the permuted size is known without counting on the host, and the per-expert counts stay
    on the device (the grouped GEMMs take them there). The same rows, probabilities and order as megatron's; rows
    gathered and combined as GlmMoeDsa's Experts do (the same rounding, forward and backward)."""

    ordered_combine = True  # False: megatron's scatter_add_ (benchmarks/megatron_layerwise.py compares the two)
    # Rows gathered by advanced indexing, whose backward sums a token's k row gradients in float32 in one pass (CUDA's
    # sort-based index_put_), as GlmMoeDsa's; False: megatron's index_select, whose backward adds them with atomics
    # in the activations' dtype (bf16), in no fixed order.
    gather_by_index = True

    def _all_local(self) -> bool:
        return self.num_local_experts == self.config.num_moe_experts and not self.config.moe_permute_fusion

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if not self._all_local():
            return super().dispatch_postprocess(hidden_states, probs)
        self.hidden_shape_before_permute = hidden_states.shape
        self.local_map = self.routing_map.contiguous()
        T, E = self.local_map.shape
        k = self.router_topk
        # GlmMoeDsa's grouped layout: each token's k experts ascending, its (token, slot) rows stably sorted by expert
        # (expert-major, tokens ascending within an expert: the rows megatron's permute makes).
        expert_ids = self.local_map.to(torch.int8).sort(dim=1, descending=True, stable=True).indices[:, :k]  # (T, k)
        narrow = torch.uint8 if E <= 256 else torch.int16 if E <= 32768 else expert_ids.dtype
        self.slot_order = torch.sort(expert_ids.reshape(-1).to(narrow), stable=True).indices  # (T * k,) row -> slot
        tokens_per_expert = self.local_map.sum(dim=0).long()
        if not self.gather_by_index:
            permuted, permuted_probs, self.reversed_local_input_permutation_mapping, _, _ = permute(
                hidden_states, self.local_map, probs=probs.contiguous(), num_out_tokens=T * k)
        else:  # megatron's permute, but the rows and probabilities gathered as GlmMoeDsa's Experts gather them
            tokens = self.slot_order // k
            permuted = hidden_states[tokens]
            permuted_probs = probs.gather(1, expert_ids).reshape(-1)[self.slot_order]
            self.reversed_local_input_permutation_mapping = tokens
        self.local_probs = permuted_probs
        self.routing_map = None
        return permuted, tokens_per_expert, permuted_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Each token's k expert rows (N = T x k, D) put back in (token, slot) order and summed over the slots in
        ascending expert order, as GlmMoeDsa's Experts do: the rows are a permutation, so neither direction
        accumulates (megatron's unpermute adds them with scatter_add_, on a GPU atomics in no fixed order)."""
        if not (self._all_local() and self.ordered_combine):
            return super().combine_preprocess(hidden_states)
        T = self.local_map.shape[0]
        unsorted = torch.empty_like(hidden_states).index_copy_(0, self.slot_order, hidden_states)
        return unsorted.view(T, self.router_topk, -1).sum(1)


class GlmTopKRouter(TopKRouter):
    """megatron's router with GlmMoeDsa's top-k (slime_dsa.models.glm_moe_dsa.route): the same experts and weights,
    normalised in the same order (megatron's sums them in top-k order, by score while training)."""

    glm_topk = True  # False: megatron's own (benchmarks/megatron_layerwise.py compares the two)
    torch_gating = True  # logits through torch's linear (its backward) as GlmMoeDsa's; False: megatron's function

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """(.., D) -> float32 logits (.., E), as GlmMoeDsa's Router computes them."""
        if not self.torch_gating or self.config.moe_router_dtype != "fp32" or self.bias is not None:
            return super().gating(input)
        return F.linear(input.float(), self.weight.float())

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """logits (.., E) float32 -> probs (T, E) (0 where not chosen), routing_map (T, E) bool."""
        if not self.glm_topk:
            return super().routing(logits, padding_mask)
        config = self.config
        logits = logits.view(-1, config.num_moe_experts)
        n_group = config.moe_router_num_groups or 1
        bias = self.expert_bias.float() if self.expert_bias is not None else logits.new_zeros(logits.shape[-1]).float()
        weights, expert_ids = route(torch.sigmoid(logits.float()), bias, self.topk, n_group,
                                    config.moe_router_group_topk or n_group, True,
                                    config.moe_router_topk_scaling_factor or 1.0)
        probs = torch.zeros_like(logits, dtype=weights.dtype).scatter(1, expert_ids, weights).type_as(logits)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, expert_ids, True)
        self._apply_expert_bias(routing_map, padding_mask=padding_mask)
        return probs, routing_map


class RoundedMoELayer(MoELayer):
    """MoELayer whose routed experts' float32 sum is rounded to the parameters' dtype before the shared expert's
    output is added (GlmMoeDsa's MoE: experts(x).to(x.dtype) + shared_experts(x)); its dispatch is sync-free when
    the rank holds every expert."""

    shared_expert_last = True  # False: megatron's order (benchmarks/megatron_layerwise.py compares the two)

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, **kwargs) -> None:
        pg_collection = pg_collection or get_default_pg_collection()
        super().__init__(config, submodules, layer_number, pg_collection, **kwargs)
        if type(self.token_dispatcher) is MoEAllGatherTokenDispatcher and not self.shared_expert_overlap:
            self.token_dispatcher = LocalExpertsDispatcher(self.num_local_experts, self.local_expert_indices,
                                                           config=self.config, pg_collection=pg_collection)

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):
        """megatron's steps in GlmMoeDsa's order: router, routed experts, then the shared expert (megatron runs the
        shared expert first). Autograd sums the input's gradient contributions in reverse order of their use, and
        in bf16 another order rounds differently."""
        plain = (intermediate_tensors is None and padding_mask is None and self.shared_expert_last
                 and not self.shared_expert_overlap and not self.config.moe_latent_size
                 and not (self.moe_layer_recompute and self.training)
                 and not hasattr(self, "_inference_token_dispatcher")
                 and self.fwd_execution_map == ["route", "expert_compute", "postprocess"])
        if not plain:
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        probs, routing_map = self.route(hidden_states)
        dispatched, probs = self.preprocess(hidden_states, probs, routing_map)
        dispatched, probs = self.dispatch(dispatched, probs)
        output, mlp_bias = self.routed_experts_compute(dispatched, probs)
        output = self.combine(output)
        return self.postprocess(output, self.shared_experts_compute(hidden_states)), mlp_bias

    def postprocess(self, output: torch.Tensor, shared_expert_output: torch.Tensor | None):
        return super().postprocess(output.to(self.config.params_dtype), shared_expert_output)


def moe_spec(num_experts: int):
    """megatron's local MoE spec (router, shared expert) as RoundedMoELayer with GroupedSequentialMLP experts."""
    spec = get_moe_module_spec(use_te=False, num_experts=num_experts)
    submodules = spec.keywords["submodules"]
    submodules.experts = partial(GroupedSequentialMLP, submodules=submodules.experts.keywords["submodules"])
    submodules.router = GlmTopKRouter
    shared = submodules.shared_experts.keywords["submodules"]
    submodules.shared_experts = partial(SplitGluSharedExpertMLP, submodules=shared)
    return partial(RoundedMoELayer, *spec.args, **spec.keywords)
