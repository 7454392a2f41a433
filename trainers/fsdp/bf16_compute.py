"""Mixed precision on one unsharded rank: a bf16 copy of the float32 master runs forward and backward.

What FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32) computes on a group of one rank, to the
bit, micro-batch gradients summed in float32 as there (tests/test_bf16_compute.py), without its per-parameter casts,
copies and hooks every forward and backward: on one GPU those were ~11,000 copy calls a step for the small preset's
788 parameters (benchmarks/RESULTS.md). The price is memory: the whole bf16 copy stays resident (half the float32
weights), where FSDP2 holds one layer's.
"""

from __future__ import annotations

import copy

import torch

from slime_dsa.devices import foreach_copy
from slime_dsa.models.glm_moe_dsa import Experts, float32_modules
from trainers.grad_sums import add_gradients


class Bf16Compute:
    """A bf16 copy of `master` that computes; each backward's gradients are summed into the master's in float32
    (`accumulate_gradients`), and the copy is refreshed from the master after every update (call `refresh` after
    anything writes the master's weights).
    The routers and indexer heads (float32_modules) stay float32, as apply_fsdp's own float32 policy for them."""

    def __init__(self, master: torch.nn.Module) -> None:
        self.master = master
        self.module = copy.deepcopy(master)
        kept = {id(p) for module in float32_modules(self.module) for p in module.parameters()}
        for p in self.module.parameters():  # parameters only: buffers keep their dtype, as under FSDP2's policy
            if id(p) not in kept:
                p.data = p.data.to(torch.bfloat16)
        self._pairs = [(m, c) for m, c in zip(master.parameters(), self.module.parameters())]
        self._buffer_pairs = list(zip(master.buffers(), self.module.buffers()))  # walked once: ms at ~800 tensors
        for m, c in self._pairs:
            c.requires_grad_(m.requires_grad)
        # Each layer's routed experts compute with two stacked leaves (Experts.stack_as_leaves): ~100 gradients a
        # layer become two, each summed into a span of the flat buffer that holds those experts' master gradients.
        leaves = []  # (the master's weights in the leaf's order, the leaf)
        for master_experts, copy_experts in zip(master.modules(), self.module.modules()):
            if isinstance(copy_experts, Experts) and _trains_alike(master_experts):
                gate_up, down = copy_experts.stack_as_leaves()
                leaves.append(([w for e in master_experts for w in (e.gate_proj.weight, e.up_proj.weight)], gate_up))
                leaves.append(([e.down_proj.weight for e in master_experts], down))
        in_leaves = {id(w) for weights, _ in leaves for w in weights}
        self._grad_pairs = [(m, c) for m, c in self._pairs if id(m) not in in_leaves]  # the copy's own gradients
        # The master's float32 gradients, kept across steps: a step's first micro-batch copies into them, so nothing
        # needs zeroing and a skipped step's values are overwritten; a set_to_none elsewhere leaves them here.
        trained = [(weights, leaf) for weights, leaf in leaves if leaf.requires_grad]
        self._grads = GradBuffers([m for m, _ in self._pairs if m.requires_grad],
                                  layout=[w for weights, _ in trained for w in weights])
        # (master weights, their gradients' views, the leaf, those views' span viewed as the leaf)
        self._leaves = [(weights, [self._grads[w] for w in weights], leaf, self._grads.span(weights).view_as(leaf))
                        for weights, leaf in trained]

    def train(self, mode: bool = True) -> None:
        self.master.train(mode)
        self.module.train(mode)

    def zero_grad(self) -> None:
        """Clear the copy's and the master's gradients (the master's optimizer holds a subset of them); the master's
        float32 buffers stay allocated for the next step. A parameter no micro-batch reaches keeps .grad None."""
        for m, c in self._pairs:
            m.grad = c.grad = None
        for _, _, leaf, _ in self._leaves:
            leaf.grad = None

    @torch.no_grad()
    def accumulate_gradients(self) -> None:
        """Add the copy's gradients (one micro-batch's) into the master's .grad in float32 and clear the copy's.

        Call after every backward: FSDP2 casts each backward's gradients to float32 (reduce_dtype) and sums
        micro-batches there; autograd would sum them in bf16 in the copy's .grad."""
        have = [(m, c) for m, c in self._grad_pairs if c.grad is not None]
        first = [(m, c) for m, c in have if m.grad is None]
        later = [(m.grad, c.grad) for m, c in have if m.grad is not None]
        copies = [(self._grads[m], c.grad) for m, c in first]
        stacked = [entry for entry in self._leaves if entry[2].grad is not None]
        for weights, _, leaf, span in stacked:  # a layer's expert gradients are set and cleared together
            (copies if weights[0].grad is None else later).append((span, leaf.grad))
        add_gradients(copies, later)
        for m, _ in first:
            m.grad = self._grads[m]
        for weights, grads, leaf, _ in stacked:
            for w, grad in zip(weights, grads):
                w.grad = grad
            leaf.grad = None
        for _, c in have:
            c.grad = None

    @torch.no_grad()
    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor | None:
        """torch's clip_grad_norm_(params, max_norm) as one norm and one multiply over the gradients' flat buffer;
        None where `params` are not the master's trainable parameters with their gradients in it (clip them otherwise).
        torch's walks the ~800 gradients on the host: per-tensor norms, a stack of them, and the multiply."""
        return self._grads.clip(params, max_norm)

    @torch.no_grad()
    def refresh(self) -> None:
        """Round the master's weights (and buffers) into the copy."""
        foreach_copy([c for _, c in self._pairs], [m for m, _ in self._pairs])
        if self._buffer_pairs:
            foreach_copy([c for _, c in self._buffer_pairs], [m for m, _ in self._buffer_pairs])


class GradBuffers(dict):
    """Each parameter's float32 gradient, kept across steps (keyed by the parameter, as torch.optim keys its state):
    those of `flat_params` as views of one flat buffer, allocated at once, so a clip is one norm and one multiply;
    any other parameter's allocated when it first gets one."""

    def __init__(self, flat_params: list[torch.Tensor], layout: list[torch.Tensor] = ()) -> None:
        """layout: parameters (of flat_params) whose views come first, in this order (`span` of consecutive ones)."""
        super().__init__()
        self.flat_params = [p for p in flat_params if p.dtype == torch.float32 and p.is_contiguous()]
        device = self.flat_params[0].device if self.flat_params else None
        # No padding between the views: every element belongs to one, so a step's copies and zeros cover it all
        self.flat = torch.zeros(sum(p.numel() for p in self.flat_params), dtype=torch.float32, device=device)
        in_flat = {id(p) for p in self.flat_params}
        first = [p for p in layout if id(p) in in_flat]
        placed = {id(p) for p in first}
        self._offsets: dict[int, int] = {}
        offset = 0
        for param in first + [p for p in self.flat_params if id(p) not in placed]:
            self[param] = self.flat[offset:offset + param.numel()].view_as(param)
            self._offsets[id(param)] = offset
            offset += param.numel()

    def span(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The flat buffer's elements of `params`, which must lie next to each other in this order (see layout)."""
        start = offset = self._offsets[id(params[0])]
        for param in params:
            if self._offsets.get(id(param)) != offset:
                raise ValueError("GradBuffers.span: the parameters are not consecutive in the flat buffer")
            offset += param.numel()
        return self.flat[start:offset]

    def __missing__(self, param: torch.Tensor) -> torch.Tensor:
        self[param] = grad = torch.empty_like(param)
        return grad

    def clip(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor | None:
        """Scale the gradients of `params` (exactly flat_params, each .grad None or its view) to a total norm of at
        most max_norm, as torch.nn.utils.clip_grad_norm_ does; returns the norm before, or None when they are not."""
        if len(params) != len(self.flat_params):
            return None
        unreached = []
        for param, flat_param in zip(params, self.flat_params):
            if param is not flat_param:
                return None
            if param.grad is None:  # its view holds an earlier step's values: zero adds nothing to the norm
                unreached.append(self[param])
            elif param.grad is not self[param]:
                return None
        if unreached:
            torch._foreach_zero_(unreached)
        total = torch.linalg.vector_norm(self.flat)
        self.flat.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total


def _trains_alike(experts: torch.nn.Module) -> bool:
    """Whether every float32 weight of these experts trains, or none does (one stacked leaf holds them all)."""
    weights = list(experts.parameters())
    return len({p.requires_grad for p in weights}) == 1 and all(p.dtype == torch.float32 for p in weights)
