"""Training–inference mismatch corrections, per token, from k = π_old(y_t) / π_roll(y_t) (§3).

Both π_old and π_roll are fixed during the step, so the weights carry no gradient.
  IcePop (Ring-1T): M(k) = k if α ≤ k ≤ β else 0. Masked tokens still count in the loss denominator.
  TIS (Yao et al.): min(k, C), no mask.
"""

from __future__ import annotations

import torch

from slime_dsa.algorithms.utils import masked_mean, upcast


def mismatch_log_ratio(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor) -> torch.Tensor:
    """(T,) log k = log π_old - log π_roll, detached."""
    return (upcast(old_logprobs) - upcast(rollout_logprobs)).detach()


def icepop_weights(log_k: torch.Tensor, alpha: float = 0.5, beta: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """M(k) per token (T,) and the bool (T,) of tokens it masks out (k outside [α, β])."""
    k = torch.exp(log_k.clamp(-20.0, 20.0))
    keep = (k >= alpha) & (k <= beta)
    return torch.where(keep, k, torch.zeros_like(k)), ~keep


def tis_weights(log_k: torch.Tensor, cap: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """min(k, C) per token (T,) and the bool (T,) of tokens whose weight was capped."""
    k = torch.exp(log_k.clamp(-20.0, 20.0))
    return k.clamp(max=cap), k > cap


def mismatch_metrics(log_k: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean |log k| = mean |log π_old - log π_roll| over generated tokens: a weight-sync error shows up here."""
    return {"train_rollout_logprob_abs_diff": masked_mean(log_k.abs(), loss_mask).detach()}


def logprob_agreement_sums(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                           loss_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """How a forward's log-probs agree with the engine's over trained tokens, as sums that add across micro-batches
    and ranks: |Δlogp| ("sync_logprob_abs_diff/num" and "/den"), its max, and the bit-equal count
    ("sync_logprob_exact")."""
    trained = loss_mask > 0
    gap = torch.where(trained, (logprobs - rollout_logprobs).abs(), 0.0)
    count = trained.sum()
    return {"sync_logprob_abs_diff/num": gap.sum(), "sync_logprob_abs_diff/den": count,
            "sync_logprob_abs_diff_max": gap.max() if gap.numel() else gap.new_zeros(()),
            "sync_logprob_exact/num": ((logprobs == rollout_logprobs) & trained).sum(), "sync_logprob_exact/den": count}

