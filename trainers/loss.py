"""Turn a recipe's algorithm section into the per-micro-batch loss function a trainer rank calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from slime_dsa.algorithms import LossInputs, build_policy_loss
from trainers.base import TrainBatch

# Metrics the loss already normalises by the step-wide denominator: their micro-batch values add up.
SHARE_METRICS = {"loss", "pg_loss", "kl_ref"}


@dataclass
class DSATraining:
    """How a trainer rank treats the DSA indexer: auxiliary indexer loss (ALGORITHMS.md section 6) and index replay."""

    indexer_loss_coef: float = 0.0  # 0 = no indexer loss (no capture, no extra cost)
    indexer_stage: str = "sparse"  # sparse: KL on the selected keys; dense: on every causal key
    indexer_target: str = "group"  # group: mean attention of the IndexShare group; own: the full layer only
    indexer_learning_rate: float | None = None  # a separate AdamW param group for the indexers; None = the main lr
    index_replay: bool = False  # replay the engines' top-k (batch.rollout_topk) instead of only comparing with it


def dsa_training_config(algorithm: Any) -> DSATraining:
    """The DSATraining of an AlgorithmSection (keys that a section lacks keep their defaults)."""
    return DSATraining(
        indexer_loss_coef=algorithm.indexer_loss_coef,
        indexer_stage=getattr(algorithm, "indexer_loss_stage", "sparse"),
        indexer_target=getattr(algorithm, "indexer_loss_target", "group"),
        indexer_learning_rate=getattr(algorithm, "indexer_learning_rate", None),
        index_replay=algorithm.index_replay,
    )


def policy_loss_config(algorithm: Any) -> tuple[str, dict[str, Any]]:
    """(registry name, options) for the policy loss of an AlgorithmSection; options["dsa"] is its DSATraining."""
    name, options = _policy_loss_options(algorithm)
    return name, {**options, "dsa": dsa_training_config(algorithm)}


def _policy_loss_options(algorithm: Any) -> tuple[str, dict[str, Any]]:
    common = {"aggregation": algorithm.loss_aggregation, "kl_coef": algorithm.kl_coef,
              "kl_estimator": algorithm.kl_estimator, "entropy_coef": algorithm.entropy_coef}
    if algorithm.name in ("async_reinforce", "sao"):
        return "dis", {**common, "eps_low": algorithm.dis_eps_low, "eps_high": algorithm.dis_eps_high}
    options = {**common, "eps_low": algorithm.eps_clip_low, "eps_high": algorithm.eps_clip_high,
               "dual_clip": algorithm.dual_clip_c, "is_correction": algorithm.is_correction,
               "bypass": algorithm.use_rollout_logprobs}
    if algorithm.is_correction == "icepop":
        options.update(icepop_alpha=algorithm.icepop_alpha, icepop_beta=algorithm.icepop_beta)
    elif algorithm.is_correction == "tis":
        options.update(tis_cap=algorithm.tis_cap)
    return "grpo", options


@dataclass
class PolicyLossFn:
    """Callable (logprobs, micro-batch, entropy, step tokens, step samples) -> (loss, token-weighted metrics)."""

    name: str
    options: dict[str, Any]

    def __post_init__(self) -> None:
        options = dict(self.options)
        self.dsa: DSATraining = options.pop("dsa", None) or DSATraining()  # read by the trainer rank, not the loss
        self.loss = build_policy_loss(self.name, **options)

    def __call__(self, logprobs: torch.Tensor, mb: TrainBatch, entropy: torch.Tensor | None,
                 step_loss_tokens: float, step_num_samples: int) -> tuple[torch.Tensor, dict[str, float]]:
        device = logprobs.device
        sample_index = torch.repeat_interleave(torch.arange(len(mb.seqlens), device=device), torch.tensor(mb.seqlens, device=device))
        token_mean = self.loss.aggregation == "token_mean"
        inputs = LossInputs(
            logprobs=logprobs, advantages=mb.advantages.to(device), loss_mask=mb.loss_mask.to(device).float(),
            sample_index=sample_index,
            old_logprobs=mb.old_logprobs.to(device) if mb.old_logprobs is not None else None,
            rollout_logprobs=mb.rollout_logprobs.to(device),
            ref_logprobs=mb.ref_logprobs.to(device) if mb.ref_logprobs is not None else None,
            entropy=entropy,
            denominator=max(step_loss_tokens, 1.0) if token_mean else max(step_num_samples, 1),
        )
        out = self.loss(inputs)
        share = float(mb.loss_mask.sum()) / max(step_loss_tokens, 1.0)  # this micro-batch's share of the step's tokens
        metrics = {}
        for key, value in out.metrics.items():
            value = float(value)
            if key in SHARE_METRICS:
                metrics[key] = value
            elif key.endswith("_max"):
                metrics[key] = value
            else:
                metrics[key] = value * share
        return out.loss, metrics
