"""Asynchronous REINFORCE with direct double-sided IS (GLM-5 §3.3; docs/algorithms.md §4): the asynchronous loop."""

from __future__ import annotations

from typing import TYPE_CHECKING

from slime_dsa.algorithms.specs.base import AdvantageInputs, Algorithm, OldLogprobs

if TYPE_CHECKING:
    import torch

    from slime_dsa.algorithms.policy_loss import PolicyLoss


class AsyncReinforce(Algorithm):
    """Group-centred advantages; the ratio is taken against π_roll directly, so no π_old is computed."""

    name = "async_reinforce"
    loop = "async"
    advantage_source = "group"
    min_group_size = 2
    options = frozenset({"dis_eps_low", "dis_eps_high", "max_staleness", "partial_rollout"})

    @property
    def old_logprobs(self) -> OldLogprobs:
        return "none"

    def advantages(self, inputs: AdvantageInputs) -> torch.Tensor:
        from slime_dsa.algorithms.advantages import group_centered_advantages  # noqa: PLC0415

        return group_centered_advantages(inputs.rewards, group_ids=inputs.group_ids)

    def policy_loss(self) -> PolicyLoss:
        from slime_dsa.algorithms.dis import DISLoss  # noqa: PLC0415

        return DISLoss(**self.loss_common(), eps_low=self.section.dis_eps_low, eps_high=self.section.dis_eps_high)
