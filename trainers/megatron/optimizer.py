"""megatron-core's DistributedOptimizer behind the calls the shared step makes (zero_grad, step, param_groups, and
clip before step), with our learning-rate schedule. Used on GPUs: bf16 parameters, float32 main weights and Adam
moments sharded over the data-parallel ranks."""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer

from trainers.base import OptimizerConfig
from trainers.optim import lr_multiplier


class DistributedAdam:
    """Adam over float32 main weights sharded across data-parallel ranks (megatron's DistributedOptimizer)."""

    def __init__(self, model: DistributedDataParallel, config: OptimizerConfig, indexer_learning_rate: float | None,
                 dtype: torch.dtype) -> None:
        if indexer_learning_rate is not None:
            raise ValueError("algorithm.indexer_learning_rate is not built for megatron's DistributedOptimizer (GPU) "
                             "yet; leave it null")
        beta1, beta2 = config.adam_betas
        self.config = MegatronOptimizerConfig(
            optimizer="adam", lr=config.learning_rate, weight_decay=config.weight_decay, adam_beta1=beta1,
            adam_beta2=beta2, adam_eps=1e-8, clip_grad=config.max_grad_norm, bf16=dtype == torch.bfloat16,
            params_dtype=dtype, use_distributed_optimizer=True)
        self.inner = get_megatron_optimizer(self.config, [model])

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def clip(self, max_norm: float) -> torch.Tensor:
        """Copy the model's gradients into the float32 main gradients, clip them by their global norm; that norm."""
        self.inner.prepare_grads()
        norm = self.inner.clip_grad_norm(max_norm) if max_norm > 0 else self.inner.get_grad_norm()
        return torch.as_tensor(float(norm))

    def step(self) -> None:
        """Adam on the main weights, then the bf16 parameters gathered back from every shard."""
        self.inner.step_with_ready_grads()


class LambdaSchedule:
    """trainers.optim's warm-up and decay for an optimizer that is not a torch.optim.Optimizer."""

    def __init__(self, optimizer, warmup_steps: int, total_steps: int, schedule: str) -> None:
        self.optimizer, self.warmup, self.total, self.schedule = optimizer, warmup_steps, total_steps, schedule
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.last_epoch = 0
        self._apply()

    def _apply(self) -> None:
        factor = lr_multiplier(self.last_epoch, self.warmup, self.total, self.schedule)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * factor

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def step(self) -> None:
        self.last_epoch += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch, "base_lrs": self.base_lrs}

    def load_state_dict(self, state: dict) -> None:
        self.last_epoch, self.base_lrs = state["last_epoch"], state["base_lrs"]
        self._apply()
