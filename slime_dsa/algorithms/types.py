"""What a loss takes and returns: packed per-token tensors in, a scalar and metrics out."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

_PER_CANDIDATE = ("candidate_logprobs", "candidate_target_logprobs", "candidate_mask")


@dataclass
class LossInputs:
    """Per-token tensors of a packed batch, (T,) over the concatenated tokens of its samples ((T, K) per candidate).

    Tokens of one sample need not be contiguous, but must appear in time order (GAE relies on it).
    """

    logprobs: torch.Tensor  # (T,) float, log π_θ(y_t) of the policy being trained (carries the gradient)
    advantages: torch.Tensor  # (T,) float, A_{i,t}
    loss_mask: torch.Tensor  # (T,) float, 1 on tokens the policy generated, 0 on prompt/tool/environment tokens
    sample_index: torch.Tensor  # (T,) long, which sample each token belongs to (0..N-1)
    old_logprobs: torch.Tensor | None = None  # (T,) log π_old(y_t), recomputed by the trainer at step start
    rollout_logprobs: torch.Tensor | None = None  # (T,) log π_roll(y_t), as reported by the engine
    ref_logprobs: torch.Tensor | None = None  # (T,) log π_ref(y_t) of the reference model, for a KL penalty
    entropy: torch.Tensor | None = None  # (T,) per-token entropy of π_θ, for the metric / entropy bonus
    # A target distribution known at K candidate ids per row (a teacher's top-k), for a sparse KL:
    candidate_logprobs: torch.Tensor | None = None  # (T, K) log π_θ at the candidate ids (carries the gradient)
    candidate_target_logprobs: torch.Tensor | None = None  # (T, K) the target's log-probs at the same ids
    candidate_mask: torch.Tensor | None = None  # (T,) float, 1 on rows whose loss uses the candidates
    # What the aggregate divides by instead of this batch's own count (masked tokens for token_mean, samples
    # for seq_mean): pass the whole step's count when a step is split into micro-batches.
    denominator: float | torch.Tensor | None = None

    def __post_init__(self) -> None:
        shape = self.logprobs.shape
        if self.logprobs.dim() != 1:
            raise ValueError(f"logprobs must be 1-D (T,) over packed tokens, got shape {tuple(shape)}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _PER_CANDIDATE or f.name == "denominator" or not isinstance(value, torch.Tensor):
                continue
            if value.shape != shape:
                raise ValueError(f"{f.name} must have shape {tuple(shape)} like logprobs, got {tuple(value.shape)}")
        given = [name for name in _PER_CANDIDATE if getattr(self, name) is not None]
        if given and len(given) < len(_PER_CANDIDATE):
            missing = sorted(set(_PER_CANDIDATE) - set(given))
            raise ValueError(f"{missing[0]} is required with {given[0]}")
        if given:
            rows = self.candidate_logprobs.shape
            if len(rows) != 2 or rows[0] != shape[0] or self.candidate_target_logprobs.shape != rows:
                raise ValueError(f"candidate_logprobs {tuple(rows)} and candidate_target_logprobs "
                                 f"{tuple(self.candidate_target_logprobs.shape)} must both be ({shape[0]}, K)")
            if self.candidate_mask.shape != shape:
                raise ValueError(f"candidate_mask must have shape {tuple(shape)}, got {tuple(self.candidate_mask.shape)}")
        if self.sample_index.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"sample_index must be an integer tensor, got {self.sample_index.dtype}")
        if not self.loss_mask.is_floating_point():
            raise ValueError(f"loss_mask must be a float tensor (1 on generated tokens), got {self.loss_mask.dtype}")


@dataclass
class LossOutputs:
    """A scalar loss to call .backward() on, and detached metrics (0-d tensors: no host sync here)."""

    loss: torch.Tensor  # () float
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
