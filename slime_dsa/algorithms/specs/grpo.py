"""GRPO with Clip-Higher, dual clip and IcePop / TIS (docs/algorithms.md §1-§3): the synchronous loop."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from slime_dsa.algorithms.specs.base import AdvantageInputs, Algorithm, OldLogprobs

if TYPE_CHECKING:
    import torch

    from slime_dsa.algorithms.policy_loss import PolicyLoss

# The algorithm keys each is_correction mode reads (policy_loss passes them to PPOLoss only in that mode).
CORRECTION_KEYS: dict[str, tuple[str, ...]] = {"icepop": ("icepop_alpha", "icepop_beta"), "tis": ("tis_cap",)}


class GRPO(Algorithm):
    """Group-normalised advantages, the clipped ratio against π_old (recomputed, or the engine's in bypass mode)."""

    name = "grpo"
    loop = "sync"
    advantage_source = "group"
    min_group_size = 2
    options = frozenset({"advantage_std_normalize", "eps_clip_low", "eps_clip_high", "dual_clip_c", "is_correction",
                         "icepop_alpha", "icepop_beta", "tis_cap", "use_rollout_logprobs"})

    @classmethod
    def check(cls, section: Any) -> None:
        from slime_dsa.config.errors import RecipeValueError  # noqa: PLC0415

        for correction, keys in CORRECTION_KEYS.items():
            changed = [key for key in keys if getattr(section, key) != type(section).model_fields[key].default]
            if changed and section.is_correction != correction:
                raise RecipeValueError(f"{changed[0]} ({getattr(section, changed[0])}) only applies with "
                                       f"is_correction: {correction}", changed[0], "is_correction")
        if section.is_correction != "none" and section.use_rollout_logprobs:
            raise RecipeValueError(
                f"is_correction ('{section.is_correction}') compares π_old with π_roll, which are the same with "
                "use_rollout_logprobs: true", "is_correction", "use_rollout_logprobs")

    @property
    def old_logprobs(self) -> OldLogprobs:
        return "rollout" if self.section.use_rollout_logprobs else "recompute"

    def advantages(self, inputs: AdvantageInputs) -> torch.Tensor:
        from slime_dsa.algorithms.advantages import group_advantages  # noqa: PLC0415

        return group_advantages(inputs.rewards, group_ids=inputs.group_ids,
                                normalize_std=self.section.advantage_std_normalize)

    def policy_loss(self) -> PolicyLoss:
        from slime_dsa.algorithms.ppo import PPOLoss  # noqa: PLC0415

        s = self.section
        options: dict[str, Any] = {"eps_low": s.eps_clip_low, "eps_high": s.eps_clip_high, "dual_clip": s.dual_clip_c,
                                   "is_correction": s.is_correction, "bypass": s.use_rollout_logprobs}
        if s.is_correction == "icepop":
            options.update(icepop_alpha=s.icepop_alpha, icepop_beta=s.icepop_beta)
        elif s.is_correction == "tis":
            options.update(tis_cap=s.tis_cap)
        return PPOLoss(**self.loss_common(), **options)
