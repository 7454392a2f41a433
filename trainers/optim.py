"""AdamW with warmup then constant / linear / cosine decay; shared by every backend and by SFT."""

from __future__ import annotations

import math

import torch

from trainers.base import OptimizerConfig


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float],
                    fused: bool = False) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; norms, biases and 1-d tensors get no weight decay.

    fused: torch's fused AdamW kernel (CPU or CUDA, plain tensors), else torch's default implementation.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if _ndim(p) >= 2 else no_decay).append(p)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(decay) + len(no_decay) == len(trainable), "parameter groups must cover the trainable parameters"
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, fused=fused or None)


def build_role_optimizer(model: torch.nn.Module, config: OptimizerConfig, indexer_learning_rate: float | None = None,
                         fused: bool = False) -> torch.optim.AdamW:
    """A role's AdamW; with indexer_learning_rate the DSA indexers get param groups of their own at that rate."""
    if indexer_learning_rate is None:
        return build_optimizer(model, config.learning_rate, config.weight_decay, tuple(config.adam_betas), fused=fused)
    groups = []
    for is_indexer, lr in ((False, config.learning_rate), (True, indexer_learning_rate)):
        params = [p for n, p in model.named_parameters() if p.requires_grad and (".indexer." in n) == is_indexer]
        groups += [{"params": [p for p in params if _ndim(p) >= 2], "weight_decay": config.weight_decay, "lr": lr},
                   {"params": [p for p in params if _ndim(p) < 2], "weight_decay": 0.0, "lr": lr}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=config.learning_rate,
                             betas=tuple(config.adam_betas), eps=1e-8, fused=fused or None)


def _ndim(p: torch.Tensor) -> int:
    """A parameter's rank; a DeepSpeed ZeRO-3 partition (a flat slice) keeps its whole shape as ds_shape."""
    return len(getattr(p, "ds_shape", p.shape))


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float = 0.1) -> float:
    """Linear warmup over warmup_steps, then the schedule's decay to min_ratio at total_steps."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr_schedule {schedule!r} is not one of constant, linear, cosine")


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, schedule: str) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, warmup_steps, total_steps, schedule))
