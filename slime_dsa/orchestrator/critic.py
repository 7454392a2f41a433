"""A step's critic, for algorithms with a critic role (sao): its values before any update, the spec's per-token
advantages and value targets from them, and the critic's updates (critic_updates_per_step passes over the step's
samples, each of trainer.num_steps_per_rollout optimiser steps, as the actor's one pass).

Metrics: critic/ (steps taken, value loss, explained variance of V_old against the targets, grad norm, lr) and
advantage/ (mean, std and mean |Â| over action tokens, plus what the spec reports: λ statistics, bootstrapped share).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from slime_dsa.algorithms.specs import Algorithm
from slime_dsa.data.sample import Sample

if TYPE_CHECKING:
    from trainers.base import TrainBatch, TrainerGroup

# Metrics of the critic's training steps that go to the log (as critic/<key>); explained variance is the driver's.
CRITIC_METRICS = ("value_loss", "vf_clipfrac", "value_mean", "returns_mean", "grad_norm")


async def critic_estimates(trainers: TrainerGroup, spec: Algorithm, batch: TrainBatch,
                           samples: list[Sample]) -> dict[str, float]:
    """Fill batch.advantages (per token), batch.returns and batch.old_values from the critic; return their metrics."""
    from slime_dsa.algorithms.gae import advantage_metrics  # noqa: PLC0415
    from slime_dsa.algorithms.utils import masked_mean  # noqa: PLC0415
    from slime_dsa.algorithms.value_loss import (  # noqa: PLC0415
        MIN_RETURN_VARIANCE, explained_variance, masked_variance,
    )
    from slime_dsa.orchestrator.batching import critic_advantage_inputs  # noqa: PLC0415

    values, final = await asyncio.to_thread(trainers.compute_values, batch)
    inputs = critic_advantage_inputs(samples, batch, values, final)
    batch.advantages = spec.advantages(inputs)
    batch.returns = spec.value_targets(inputs)
    batch.old_values = values
    mask = batch.loss_mask
    stats = advantage_metrics(batch.advantages, mask)
    metrics = {"advantage/mean": float(masked_mean(batch.advantages, mask)),
               "advantage/std": float(stats["advantage_std"]), "advantage/abs_mean": float(stats["advantage_abs_mean"]),
               "critic/old_value_mean": float(masked_mean(values, mask))}
    # Left out where every target is equal (a step whose rewards all agree): there it is undefined, and its clamped
    # value (~ -3e6) flattened the report's curve.
    if float(masked_variance(batch.returns, mask)) > MIN_RETURN_VARIANCE:
        metrics["critic/explained_variance"] = float(explained_variance(values, batch.returns, mask))
    metrics.update({f"advantage/{k}": v for k, v in spec.advantage_metrics(inputs).items()})
    return metrics


async def train_critic(trainers: TrainerGroup, spec: Algorithm, batch: TrainBatch, num_mini_batches: int,
                       detailed_metrics: bool) -> dict[str, float]:
    """spec.critic_updates_per_step passes of critic updates on the batch's targets, each of num_mini_batches
    optimiser steps; metrics averaged over passes."""
    mini_batches = min(num_mini_batches, len(batch.seqlens))
    passes = []
    for _ in range(spec.critic_updates_per_step):
        _, m = await asyncio.to_thread(trainers.train, batch, mini_batches, False, detailed_metrics, "critic")
        passes.append(m)
    metrics = {f"critic/{k}": sum(p[k] for p in passes) / len(passes) for k in CRITIC_METRICS if k in passes[0]}
    metrics["critic/lr"] = passes[-1]["lr"]
    metrics["critic/steps"] = len(passes) * mini_batches
    metrics["critic/skipped_updates"] = sum(p.get("skipped_updates", 0.0) for p in passes)
    return metrics
