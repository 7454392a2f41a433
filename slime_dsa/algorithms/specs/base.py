"""What an algorithm is to the loops and the trainer: one object, built from the recipe's algorithm section.

A spec declares its loop (sync or async), its π_old mode, where its advantages come from, the model roles it
needs, and it builds its policy loss. The orchestrator asks the spec; nothing else compares algorithm names.
Spec modules stay light (no torch at import): `recipe check` reads them to validate a recipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    import torch

    from slime_dsa.algorithms.policy_loss import PolicyLoss

Loop = Literal["sync", "async"]
OldLogprobs = Literal["recompute", "rollout", "none"]  # π_old from a trainer forward, the engine's, or unused
AdvantageSource = Literal["group", "critic", "teacher"]

# Keys of the algorithm section that every algorithm reads (the policy loss's shared frame and DSA training).
COMMON_OPTIONS = frozenset({
    "name", "loss_aggregation", "entropy_coef", "kl_coef", "kl_estimator", "indexer_loss_coef", "freeze_indexer",
    "index_replay", "indexer_learning_rate", "indexer_loss_stage", "indexer_loss_target",
})


@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage function may read, as tensors: one reward and one group id per sample."""

    rewards: torch.Tensor  # (N,) float32
    group_ids: torch.Tensor  # (N,) long: samples with the same id answered the same prompt


class Algorithm:
    """Base of every algorithm spec; subclasses set the class attributes and the two builders."""

    name: ClassVar[str]
    loop: ClassVar[Loop]
    advantage_source: ClassVar[AdvantageSource]
    roles: ClassVar[tuple[str, ...]] = ("policy",)  # model roles the trainer group must hold
    min_group_size: ClassVar[int] = 1  # smallest rollout.n_samples_per_prompt that gives a learning signal
    options: ClassVar[frozenset[str]] = frozenset()  # algorithm-section keys it reads beyond COMMON_OPTIONS

    def __init__(self, section: Any) -> None:
        self.section = section  # slime_dsa.config.schema.AlgorithmSection

    @classmethod
    def reads(cls, key: str) -> bool:
        """Whether this algorithm reads algorithm.`key`."""
        return key in COMMON_OPTIONS or key in cls.options

    @classmethod
    def check(cls, section: Any) -> None:
        """Raise RecipeValueError for option combinations this algorithm cannot honour."""

    @property
    def old_logprobs(self) -> OldLogprobs:
        """How the step gets π_old."""
        raise NotImplementedError

    def advantages(self, inputs: AdvantageInputs) -> torch.Tensor:
        """(N,) one advantage per sample, broadcast to its tokens by the batch builder."""
        raise NotImplementedError

    def policy_loss(self) -> PolicyLoss:
        """The per-token policy loss the trainer calls on every micro-batch (a picklable frozen dataclass)."""
        raise NotImplementedError

    def loss_common(self) -> dict[str, Any]:
        """The options of the policy-loss frame every algorithm shares."""
        s = self.section
        return {"aggregation": s.loss_aggregation, "kl_coef": s.kl_coef, "kl_estimator": s.kl_estimator,
                "entropy_coef": s.entropy_coef}
