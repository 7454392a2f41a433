"""What an algorithm is to the loops and the trainer: one object, built from the recipe's algorithm section.

A spec declares its loop (sync or async), its π_old mode, where its advantages come from, the model roles it
needs, and it builds its policy loss. The orchestrator asks the spec; nothing else compares algorithm names.
Spec modules stay light (no torch at import): `recipe check` reads them to validate a recipe.

Advantages come one per sample (advantage_level "sample": group sources; the batch broadcasts them to the sample's
tokens) or one per token (advantage_level "token": a critic's GAE, a teacher's reverse KL). A spec with a critic
role also gives the critic's value targets and says how the critic trains in each step (critic_updates_per_step,
trains_policy); a spec whose advantages come from a teacher says how many top log-probs it wants (teacher_topk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    import torch

    from slime_dsa.algorithms.policy_loss import PolicyLoss
    from slime_dsa.algorithms.value_loss import ValueLoss

Loop = Literal["sync", "async"]
OldLogprobs = Literal["recompute", "rollout", "none"]  # π_old from a trainer forward, the engine's, or unused
AdvantageSource = Literal["group", "critic", "teacher"]
AdvantageLevel = Literal["sample", "token"]

# Keys of the algorithm section that every algorithm reads (the policy loss's shared frame and DSA training).
COMMON_OPTIONS = frozenset({
    "name", "loss_aggregation", "entropy_coef", "kl_coef", "kl_estimator", "indexer_loss_coef", "freeze_indexer",
    "index_replay", "indexer_learning_rate", "indexer_loss_stage", "indexer_loss_target",
})


@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage function may read, as tensors: one reward and one group id per sample; for a critic's
    advantages also the packed batch's per-token tensors (T,) and the critic's values; for a teacher's, the
    student's and the teachers' log-probs of the sampled tokens and which samples have a teacher."""

    rewards: torch.Tensor  # (N,) float32
    group_ids: torch.Tensor  # (N,) long: samples with the same id answered the same prompt
    loss_mask: torch.Tensor | None = None  # (T,) float: 1 on action tokens (the model's), 0 on prompt/tool tokens
    sample_index: torch.Tensor | None = None  # (T,) long: which sample each token belongs to
    values: torch.Tensor | None = None  # (T,) V(s_t) of the critic before any update, row t: the state before token t
    final_values: torch.Tensor | None = None  # (N,) V of the state after each sample's last token
    truncated: torch.Tensor | None = None  # (N,) bool: an agent loop cut the trajectory at a limit; it goes on
    rollout_logprobs: torch.Tensor | None = None  # (T,) log π_roll of each token, as the engine sampled it
    teacher_logprobs: torch.Tensor | None = None  # (T,) log π_T of each token under its sample's teacher (0: none)
    taught: torch.Tensor | None = None  # (N,) bool: the sample's domain has a teacher

    def per_token(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss_mask, sample_index, values, final_values, truncated); ValueError naming the first one missing."""
        fields = ("loss_mask", "sample_index", "values", "final_values", "truncated")
        for name in fields:
            if getattr(self, name) is None:
                raise ValueError(f"AdvantageInputs.{name} is required for a critic's per-token advantages")
        return tuple(getattr(self, name) for name in fields)  # type: ignore[return-value]

    def teacher_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss_mask, sample_index, rollout_logprobs, teacher_logprobs, taught); ValueError naming the first one
        missing."""
        fields = ("loss_mask", "sample_index", "rollout_logprobs", "teacher_logprobs", "taught")
        for name in fields:
            if getattr(self, name) is None:
                raise ValueError(f"AdvantageInputs.{name} is required for a teacher's per-token advantages")
        return tuple(getattr(self, name) for name in fields)  # type: ignore[return-value]


class Algorithm:
    """Base of every algorithm spec; subclasses set the class attributes and the two builders."""

    name: ClassVar[str]
    loop: ClassVar[Loop]
    advantage_source: ClassVar[AdvantageSource]
    advantage_level: ClassVar[AdvantageLevel] = "sample"  # what advantages() returns: (N,) or (T,)
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
        """(N,) one advantage per sample, broadcast to its tokens by the batch builder; (T,) one per token with
        advantage_level "token"."""
        raise NotImplementedError

    def value_targets(self, inputs: AdvantageInputs) -> torch.Tensor:
        """(T,) the critic's regression targets on action tokens (specs with a critic role)."""
        raise NotImplementedError(f"algorithm {self.name!r} trains no critic")

    def advantage_metrics(self, inputs: AdvantageInputs) -> dict[str, float]:
        """What the loop logs about this step's advantage estimate beyond the advantages' own statistics."""
        return {}

    @property
    def critic_updates_per_step(self) -> int:
        """Passes of critic updates over each step's samples (0 without a critic)."""
        return 0

    def trains_policy(self, step: int) -> bool:
        """Whether RL step `step` (0-based) updates the policy; a critic warm-up says no to its first steps."""
        return True

    @property
    def teacher_topk(self) -> int:
        """Top log-probs per position each teacher returns for the loss (advantage source "teacher"); 0 = only
        the sampled tokens' log-probs."""
        return 0

    def policy_loss(self) -> PolicyLoss:
        """The per-token policy loss the trainer calls on every micro-batch (a picklable frozen dataclass)."""
        raise NotImplementedError

    def value_loss(self) -> ValueLoss:
        """The critic's per-token loss (specs with a critic role; a picklable frozen dataclass)."""
        raise NotImplementedError(f"algorithm {self.name!r} trains no critic")

    def loss_common(self) -> dict[str, Any]:
        """The options of the policy-loss frame every algorithm shares."""
        s = self.section
        return {"aggregation": s.loss_aggregation, "kl_coef": s.kl_coef, "kl_estimator": s.kl_estimator,
                "entropy_coef": s.entropy_coef}
