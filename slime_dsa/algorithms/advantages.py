"""Group advantages (GRPO, Dr. GRPO, group-centred REINFORCE) and dynamic-sampling group checks.

Rewards are per sample, (N,). A group is the G responses to one prompt, given either as `group_ids` (N,)
(any integers) or as a `group_size` (samples [0, G) form group 0, [G, 2G) group 1, ...).
"""

from __future__ import annotations

import torch

from slime_dsa.algorithms.utils import upcast


def group_index(n: int, group_ids: torch.Tensor | None = None, group_size: int | None = None) -> tuple[torch.Tensor, int]:
    """(N,) compact group index 0..G-1 of every sample (sorted by group id) and the number of groups G."""
    if (group_ids is None) == (group_size is None):
        raise ValueError("give exactly one of group_ids and group_size")
    if group_ids is not None:
        if group_ids.shape != (n,):
            raise ValueError(f"group_ids must have shape ({n},) like rewards, got {tuple(group_ids.shape)}")
        unique, inverse = torch.unique(group_ids, return_inverse=True)
        return inverse, len(unique)
    if group_size < 1 or n % group_size:
        raise ValueError(f"group_size ({group_size}) must be >= 1 and divide the number of samples ({n})")
    return torch.arange(n) // group_size, n // group_size


def _group_stats(rewards: torch.Tensor, index: torch.Tensor, n_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample group mean and unbiased group std (0 for a group of one)."""
    index = index.to(rewards.device)
    counts = rewards.new_zeros(n_groups).index_add(0, index, torch.ones_like(rewards))  # (G,)
    mean = rewards.new_zeros(n_groups).index_add(0, index, rewards) / counts  # (G,)
    centred = rewards - mean[index]
    sq = rewards.new_zeros(n_groups).index_add(0, index, centred**2)
    std = (sq / (counts - 1).clamp(min=1)).sqrt()  # Bessel-corrected, as torch.std (slime, verl)
    return mean[index], std[index]


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    group_size: int | None = None,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO: A_i = (R_i - mean(R_group)) / (std(R_group) + eps); std division off gives Dr. GRPO. (N,) -> (N,)."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    rewards = upcast(rewards)
    index, n_groups = group_index(len(rewards), group_ids, group_size)
    mean, std = _group_stats(rewards, index, n_groups)
    advantages = rewards - mean
    return advantages / (std + eps) if normalize_std else advantages


def group_centered_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor | None = None, group_size: int | None = None
) -> torch.Tensor:
    """A_i = R_i - mean(R_group), the advantage of asynchronous REINFORCE (GLM-5 async stage). (N,) -> (N,)."""
    return group_advantages(rewards, group_ids, group_size, normalize_std=False)


def zero_std_groups(
    rewards: torch.Tensor, group_ids: torch.Tensor | None = None, group_size: int | None = None, atol: float = 0.0
) -> torch.Tensor:
    """(G,) bool: groups whose rewards all agree (within atol), which DAPO dynamic sampling drops.

    Groups are ordered as `group_index` numbers them (sorted group id, or block order for group_size).
    """
    index, n_groups = group_index(len(rewards), group_ids, group_size)
    index = index.to(rewards.device)
    rewards = upcast(rewards)
    high = rewards.new_full((n_groups,), -torch.inf).scatter_reduce(0, index, rewards, "amax")
    low = rewards.new_full((n_groups,), torch.inf).scatter_reduce(0, index, rewards, "amin")
    return (high - low) <= atol


def broadcast_to_tokens(per_sample: torch.Tensor, sample_index: torch.Tensor) -> torch.Tensor:
    """(N,) per-sample values -> (T,) per-token values (each token gets its sample's value)."""
    return per_sample[sample_index]
