"""Policy losses by name: one `build_policy_loss(name, **cfg)` for recipes and trainers."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from slime_dsa.algorithms.dis import DISLoss
from slime_dsa.algorithms.policy_loss import PolicyLoss
from slime_dsa.algorithms.ppo import PPOLoss

# name -> (class, defaults the name implies); a recipe's cfg overrides them.
POLICY_LOSSES: dict[str, tuple[Callable[..., PolicyLoss], dict[str, Any]]] = {
    "ppo": (PPOLoss, {}),
    "grpo": (PPOLoss, {}),  # GRPO = the PPO clipped loss on group advantages
    "icepop": (PPOLoss, {"is_correction": "icepop"}),
    "tis": (PPOLoss, {"is_correction": "tis"}),
    "dis": (DISLoss, {}),  # async REINFORCE with direct double-sided IS (GLM-5 async, SAO)
}


def build_policy_loss(name: str, **cfg: Any) -> PolicyLoss:
    """The policy loss `name` with hyper-parameters `cfg`; unknown names or keys raise a ValueError naming them."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; choose one of {sorted(POLICY_LOSSES)}")
    cls, defaults = POLICY_LOSSES[name]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ValueError(f"policy loss {name!r} has no option {unknown[0]!r}; options: {sorted(known)}")
    return cls(**{**defaults, **cfg})
