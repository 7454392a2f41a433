"""SAO, single-rollout asynchronous optimisation (docs/algorithms.md section 5): one rollout per prompt, the DIS actor
loss against π_roll, and per-token advantages by skip-observation GAE from a value model trained beside the policy.

  actor:  Â = GAE(γ, λ_policy = clamp(1 - 1/(α·l), 0, 1)) over action tokens, l the trajectory's action tokens
  critic: R = GAE(γ, λ_critic) + V (λ_critic = 1: Monte-Carlo returns), masked MSE, optional clip around V_old
The reward sits on the last model-generated token; a trajectory an agent loop cut at a limit bootstraps from V
after its last token. Each RL step the critic takes critic_updates_per_step passes over the step's trajectories for the actor's one;
during the first critic_warmup_steps RL steps only the critic trains.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slime_dsa.algorithms.specs.base import AdvantageInputs, Algorithm, OldLogprobs

if TYPE_CHECKING:
    import torch

    from slime_dsa.algorithms.gae import GAEOutputs
    from slime_dsa.algorithms.policy_loss import PolicyLoss
    from slime_dsa.algorithms.value_loss import ValueLoss


class SAO(Algorithm):
    """Critic GAE advantages per token, DIS against π_roll (no π_old), a critic with its own steps."""

    name = "sao"
    loop = "async"
    advantage_source = "critic"
    advantage_level = "token"
    roles = ("policy", "critic")
    min_group_size = 1
    options = frozenset({"dis_eps_low", "dis_eps_high", "max_staleness", "partial_rollout", "gae_gamma",
                         "gae_lambda_alpha", "critic_gae_lambda", "critic_updates_per_step", "critic_warmup_steps",
                         "value_clip", "bootstrap_truncated"})

    @property
    def old_logprobs(self) -> OldLogprobs:
        return "none"

    def advantages(self, inputs: AdvantageInputs) -> torch.Tensor:
        from slime_dsa.algorithms.gae import length_adaptive_lambda  # noqa: PLC0415

        mask, index = inputs.loss_mask, inputs.sample_index
        lam = length_adaptive_lambda(mask, index, self.section.gae_lambda_alpha)  # (N,)
        return self._gae(inputs, lam).advantages.float()

    def value_targets(self, inputs: AdvantageInputs) -> torch.Tensor:
        return self._gae(inputs, self.section.critic_gae_lambda).returns.float()

    def advantage_metrics(self, inputs: AdvantageInputs) -> dict[str, float]:
        from slime_dsa.algorithms.gae import length_adaptive_lambda  # noqa: PLC0415
        from slime_dsa.algorithms.utils import per_sample_sum  # noqa: PLC0415

        mask, index, _, _, truncated = inputs.per_token()
        lam = length_adaptive_lambda(mask, index, self.section.gae_lambda_alpha)
        acting = per_sample_sum((mask > 0).double(), index, len(inputs.rewards)) > 0  # samples with an action token
        lam = lam[acting] if bool(acting.any()) else lam
        return {"lambda_mean": float(lam.mean()), "lambda_min": float(lam.min()), "lambda_max": float(lam.max()),
                "bootstrapped_frac": float(self._bootstraps(truncated).float().mean()) if len(truncated) else 0.0}

    def _bootstraps(self, truncated: torch.Tensor) -> torch.Tensor:
        """(N,) bool: which trajectories end on γ·V(after the last token) rather than 0."""
        return truncated & bool(self.section.bootstrap_truncated)

    def _gae(self, inputs: AdvantageInputs, lam: float | torch.Tensor) -> GAEOutputs:
        from slime_dsa.algorithms.gae import gae, rewards_on_last_action  # noqa: PLC0415

        mask, index, values, final, truncated = inputs.per_token()
        rewards = rewards_on_last_action(inputs.rewards, mask, index)
        bootstrap = final.double() * self._bootstraps(truncated)
        return gae(rewards, values, mask, index, gamma=self.section.gae_gamma, lam=lam, skip_observations=True,
                   bootstrap_values=bootstrap)

    @property
    def critic_updates_per_step(self) -> int:
        return self.section.critic_updates_per_step

    def trains_policy(self, step: int) -> bool:
        return step >= self.section.critic_warmup_steps

    def policy_loss(self) -> PolicyLoss:
        from slime_dsa.algorithms.dis import DISLoss  # noqa: PLC0415

        return DISLoss(**self.loss_common(), eps_low=self.section.dis_eps_low, eps_high=self.section.dis_eps_high)

    def value_loss(self) -> ValueLoss:
        from slime_dsa.algorithms.value_loss import ValueLoss  # noqa: PLC0415

        return ValueLoss(value_clip=self.section.value_clip, aggregation=self.section.loss_aggregation)
