"""Generalised advantage estimation over packed tokens, with the skip-observation rule of SAO (§5).

With `skip_observations` (default) the steps of a trajectory are its action tokens (loss_mask = 1) only:
tool/environment tokens in between get no value target and no advantage, and the last action token of a
turn bootstraps from the first action token of the next turn,
  δ(a_{i,N}) = r + γ V(a_{i+1,0}) - V(a_{i,N}),   Â(a_{i,N}) = δ + γ λ Â(a_{i+1,0}).
After the last step of a sample the value is 0 (the episode ended), or its bootstrap value when the trajectory was
cut by a limit (V of the state after its last token: the episode goes on past the cut).
The trajectory's reward sits on its last action token (`rewards_on_last_action`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slime_dsa.algorithms.utils import masked_mean, num_samples, per_sample_sum, upcast


@dataclass
class GAEOutputs:
    advantages: torch.Tensor  # (T,) Â_t on steps, 0 elsewhere
    returns: torch.Tensor  # (T,) value targets Â_t + V(s_t) on steps, 0 elsewhere


def rewards_on_last_action(rewards: torch.Tensor, loss_mask: torch.Tensor, sample_index: torch.Tensor) -> torch.Tensor:
    """(N,) trajectory rewards -> (T,) with each on its sample's last action token (loss_mask 1), 0 elsewhere.

    A sample without action tokens gets its reward nowhere (it has no step to credit)."""
    positions = torch.arange(loss_mask.numel(), device=loss_mask.device)
    action = loss_mask > 0
    last = torch.full((rewards.numel(),), -1, dtype=torch.long, device=loss_mask.device)
    last = last.scatter_reduce(0, sample_index[action], positions[action], reduce="amax")
    out = torch.zeros(loss_mask.shape, dtype=upcast(rewards).dtype, device=rewards.device)
    has = last >= 0
    out[last[has]] = upcast(rewards)[has]
    return out


def length_adaptive_lambda(loss_mask: torch.Tensor, sample_index: torch.Tensor, alpha: float = 1.5) -> torch.Tensor:
    """VAPO's λ_policy = 1 - 1/(α·l) per sample, l its number of action tokens. (T,) -> (N,)."""
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    lengths = per_sample_sum((loss_mask > 0).double(), sample_index)  # (N,)
    return (1.0 - 1.0 / (alpha * lengths.clamp(min=1))).clamp(min=0.0).float()


def _step_grid(steps: torch.Tensor, sample_index: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Row (sample) and column (rank among its sample's steps, in time order) of every step token."""
    order = torch.argsort(sample_index, stable=True)
    sorted_samples = sample_index[order]
    sorted_steps = steps[order].long()
    counts = torch.zeros(n, dtype=torch.long, device=steps.device).index_add(0, sample_index, steps.long())
    first = torch.cumsum(counts, 0) - counts  # steps of all earlier samples
    col_sorted = torch.cumsum(sorted_steps, 0) - 1 - first[sorted_samples]
    col = torch.empty_like(col_sorted)
    col[order] = col_sorted
    width = int(counts.max()) if n else 0
    return sample_index[steps], col[steps], width


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    sample_index: torch.Tensor,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 1.0,
    skip_observations: bool = True,
    bootstrap_values: torch.Tensor | None = None,
) -> GAEOutputs:
    """GAE per sample, backwards in time. rewards/values/loss_mask/sample_index (T,); lam a float or (N,).

    Without `skip_observations` every token of a sample is a step (single-turn responses). bootstrap_values (N,):
    V after each sample's last step (nonzero for a trajectory cut by a limit); None = 0 for every sample.
    """
    for name, t in (("values", values), ("loss_mask", loss_mask), ("sample_index", sample_index)):
        if t.shape != rewards.shape:
            raise ValueError(f"{name} must have shape {tuple(rewards.shape)} like rewards, got {tuple(t.shape)}")
    steps = loss_mask > 0 if skip_observations else torch.ones_like(loss_mask, dtype=torch.bool)
    if skip_observations and bool((rewards[~steps] != 0).any()):
        raise ValueError("rewards: nonzero on a token with loss_mask 0; observations get no value target, put it on an action token")
    n = num_samples(sample_index)
    row, col, width = _step_grid(steps, sample_index, n)
    lam_rows = torch.as_tensor(lam, dtype=torch.float64, device=rewards.device)
    if lam_rows.dim() > 1 or lam_rows.numel() not in (1, n):
        raise ValueError(f"lam must be a float or a ({n},) tensor, one per sample, got shape {tuple(lam_rows.shape)}")
    # (L+1, N) grid of steps, time-major so each backward step is contiguous. The row after a sample's last step
    # holds V(after it): 0, or its bootstrap value; the deltas past it are masked, which stops the recursion there.
    r = rewards.new_zeros(width + 1, n, dtype=torch.float64)
    v = r.clone()
    r[col, row] = rewards[steps].double()
    v[col, row] = values[steps].double()
    counts = torch.zeros(n, dtype=torch.long, device=rewards.device).index_add(0, sample_index, steps.long())  # (N,)
    if bootstrap_values is not None:
        if bootstrap_values.shape != (n,):
            raise ValueError(f"bootstrap_values must have shape ({n},), one per sample, got {tuple(bootstrap_values.shape)}")
        v[counts, torch.arange(n, device=rewards.device)] = bootstrap_values.double()
    live = torch.arange(width, device=rewards.device)[:, None] < counts[None, :]  # (L, N): a step of that sample
    delta = (r[:-1] + gamma * v[1:] - v[:-1]) * live  # (L, N)
    adv = torch.zeros_like(r)
    decay = gamma * lam_rows.expand(n)  # (N,)
    for t in range(width - 1, -1, -1):  # L iterations, each vectorised over samples
        adv[t] = delta[t] + decay * adv[t + 1]
    advantages = torch.zeros_like(upcast(values))
    returns = torch.zeros_like(advantages)
    advantages[steps] = adv[col, row].to(advantages.dtype)
    returns[steps] = (adv[col, row] + v[col, row]).to(advantages.dtype)
    return GAEOutputs(advantages=advantages, returns=returns)


@torch.no_grad()
def decoupled_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    sample_index: torch.Tensor,
    gamma: float = 1.0,
    alpha: float = 1.5,
    lam_critic: float = 1.0,
    bootstrap_values: torch.Tensor | None = None,
) -> GAEOutputs:
    """SAO/VAPO: actor advantages with length-adaptive λ_policy, critic returns with λ_critic (1 = Monte Carlo)."""
    lam_policy = length_adaptive_lambda(loss_mask, sample_index, alpha)
    policy = gae(rewards, values, loss_mask, sample_index, gamma, lam_policy, bootstrap_values=bootstrap_values)
    critic = gae(rewards, values, loss_mask, sample_index, gamma, lam_critic, bootstrap_values=bootstrap_values)
    return GAEOutputs(advantages=policy.advantages, returns=critic.returns)


def advantage_metrics(advantages: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean |Â| and the std of Â over action tokens."""
    mean = masked_mean(advantages, loss_mask)
    var = masked_mean((advantages - mean) ** 2, loss_mask)
    return {"advantage_abs_mean": masked_mean(advantages.abs(), loss_mask).detach(), "advantage_std": var.sqrt().detach()}
