"""trainer.deepspeed as the ranks receive it, and the JSON config deepspeed.initialize takes.

Every DeepSpeed default that would change the math is set explicitly: gradient clipping comes from the recipe
(DeepSpeed's own default is 1.0), the rank decides how many micro-batches make one optimizer step, and offload runs
torch's AdamW on the host unless DeepSpeed's CPU Adam is asked for (it JIT-compiles a C++ op).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DeepSpeedOptions:
    """The keys of trainer.deepspeed (slime_dsa.config.schema.DeepSpeedSection documents each)."""

    zero_stage: int = 3
    offload_optimizer: str = "none"  # none | cpu
    offload_param: str = "none"  # none | cpu (stage 3)
    cpu_adam: bool = False
    param_persistence_threshold: int = 100_000
    prefetch_bucket_size: int = 50_000_000
    reduce_bucket_size: int = 500_000_000

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload_optimizer == "cpu"

    @property
    def offloads_params(self) -> bool:
        return self.offload_param == "cpu"


def deepspeed_config(options: DeepSpeedOptions, max_grad_norm: float, bf16: bool, pin_memory: bool) -> dict[str, Any]:
    """The config dict of one role's engine. pin_memory: page-locked host buffers for offloaded tensors (CUDA)."""
    zero: dict[str, Any] = {"stage": options.zero_stage, "reduce_bucket_size": options.reduce_bucket_size}
    if options.offloads_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if options.offloads_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    if options.zero_stage == 3:
        zero["stage3_param_persistence_threshold"] = options.param_persistence_threshold
        zero["stage3_prefetch_bucket_size"] = options.prefetch_bucket_size
    return {
        # DeepSpeed wants a batch size; the rank packs its own micro-batches by tokens and never uses DeepSpeed's.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        # backward() only accumulates and step() is the boundary: the rank runs as many micro-batches as its share
        # of the step holds, which varies from step to step.
        "managed_gradient_accumulation": False,
        "gradient_clipping": max_grad_norm,  # 0 = no clipping, as in the recipe
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,  # offload with torch's AdamW: no JIT-compiled op unless cpu_adam
        "bf16": {"enabled": bf16},
        "steps_per_print": 2**31 - 1,  # the run's own metrics report the steps
    }
