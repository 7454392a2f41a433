"""megatron's DDP adding each backward's gradients into param.main_grad once, over all parameters, after the
backward: a float32 main gradient still zero takes one foreach copy (casting), the others one foreach add; megatron's
own hook adds each parameter's gradient as it arrives, one mixed-dtype kernel per parameter and micro-batch (bf16
into float32). The same float32 values (a bf16 gradient widens exactly; x + 0 = x), but for the sign of a zero: a
-0.0 gradient stays -0.0, as FSDP2 keeps it, where megatron's 0 + (-0.0) made it +0.0. Only without overlapped grad
reduction (the buckets then reduce after the step's last backward, finalize_model_grads); with it, megatron's hook."""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel

from trainers.grad_sums import add_gradients


def _leave_grad(*unused) -> None:
    """The gradient stays in param.grad until accumulate_main_grads."""


class ForeachMainGradDDP(DistributedDataParallel):
    """DistributedDataParallel whose caller calls `accumulate_main_grads()` after every backward."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._zero_main_grads = set(self.params_with_grad)  # main_grad still all zeros (the buffers start zeroed)

    def _make_backward_post_hook(self, param: torch.nn.Parameter):
        if self.ddp_config.overlap_grad_reduce:
            return super()._make_backward_post_hook(param)
        return _leave_grad

    def zero_grad_buffer(self) -> None:
        super().zero_grad_buffer()
        self._zero_main_grads = set(self.params_with_grad)

    @torch.no_grad()
    def accumulate_main_grads(self) -> None:
        """Add the parameters' .grad into their main_grad and clear .grad (megatron's hook, for all at once)."""
        if self.ddp_config.overlap_grad_reduce:
            return
        have = [p for p in self.params_with_grad if p.grad is not None]
        first = [p for p in have if p in self._zero_main_grads]
        later = [p for p in have if p not in self._zero_main_grads]
        add_gradients([(p.main_grad, p.grad) for p in first], [(p.main_grad, p.grad) for p in later])
        self._zero_main_grads.difference_update(first)
        for p in have:
            p.grad = None
