"""`Sample`: one prompt and one response as the RL loop passes it around (rollout → reward → batch → trainer).

Per-token lists (`loss_mask`, `rollout_logprobs`, `weight_versions`) cover the response tokens only, one entry per
`response_ids` token. `indexer_topk` (index replay) holds the engine's top-k of sequence rows `indexer_topk_start` ..
P+R-2 (row p produced token p+1); with `indexer_topk_start` None it is one row per response token (from P-1). In a multi-turn rollout the response holds the model's tokens and the
tool/environment tokens in between; those get `loss_mask` 0, `rollout_logprobs` 0.0 and `weight_versions` -1.
A teacher's scores (on-policy distillation) cover the response tokens too: `teacher_logprobs` one per token, and
with the top-k option `teacher_topk_ids` / `teacher_topk_logprobs` (R, k), the teacher's k likeliest ids at each.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

NO_WEIGHT_VERSION = -1  # weight_versions entry of a token the policy did not generate (tool/environment output)


class SampleStatus(str, enum.Enum):
    """Where a sample's rollout ended. `pending` until the rollout finishes."""

    PENDING = "pending"
    COMPLETED = "completed"  # the model stopped (EOS / stop string) or the agent loop ended normally
    TRUNCATED = "truncated"  # hit max_response_length (or a context limit) before stopping
    ABORTED = "aborted"  # the engine aborted the request (weight update, shutdown, cancelled)
    FAILED = "failed"  # an error in generation, a tool or the environment; the sample is not trained on


@dataclass
class Sample:
    """One prompt/response pair with everything the trainer needs; see the module docstring for per-token lists."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1 = token the policy generated, 0 = tool/environment token
    rollout_logprobs: list[float] = field(default_factory=list)  # log π_roll(y_t) as the engine reported it
    weight_versions: list[int] = field(default_factory=list)  # policy version that produced each token
    indexer_topk: np.ndarray | None = None  # (rows, n_full_layers, index_topk) int32, -1 padded: see the module doc
    indexer_topk_start: int | None = None  # sequence row of indexer_topk[0]; None = len(prompt_ids) - 1
    reward: float | None = None
    task: str = ""
    group_id: int | None = None  # samples of one prompt share a group_id (group-normalised advantages)
    index: int = 0  # unique id of this sample within the run
    status: SampleStatus = SampleStatus.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    prompt_text: str = ""
    response_text: str = ""
    answer: Any = None  # ground truth handed to the reward function
    teacher_logprobs: list[float] | None = None  # log π_T(y_t) of each response token under the domain's teacher
    teacher_topk_ids: np.ndarray | None = None  # (R, k) int32: the teacher's top-k ids at each response token
    teacher_topk_logprobs: np.ndarray | None = None  # (R, k) float32: their log-probs under the teacher

    def __post_init__(self) -> None:
        self.status = SampleStatus(self.status)
        if self.indexer_topk is not None:
            self.indexer_topk = np.asarray(self.indexer_topk, dtype=np.int32)
        if self.teacher_topk_ids is not None:
            self.teacher_topk_ids = np.asarray(self.teacher_topk_ids, dtype=np.int32)
        if self.teacher_topk_logprobs is not None:
            self.teacher_topk_logprobs = np.asarray(self.teacher_topk_logprobs, dtype=np.float32)

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def total_length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def topk_first_row(self) -> int:
        """The sequence row of indexer_topk[0]."""
        return len(self.prompt_ids) - 1 if self.indexer_topk_start is None else self.indexer_topk_start

    @property
    def tokens(self) -> list[int]:
        """Prompt then response ids: the sequence the trainer packs."""
        return self.prompt_ids + self.response_ids

    def append_tokens(
        self, ids: list[int], logprobs: list[float] | None = None, weight_versions: list[int] | None = None,
        *, trainable: bool = True,
    ) -> None:
        """Extend the response: model output (`trainable`, with its log-probs) or tool/environment tokens (masked)."""
        if trainable and (logprobs is None or len(logprobs) != len(ids)):
            raise ValueError(f"append_tokens: {len(ids)} generated tokens need as many logprobs, got "
                             f"{None if logprobs is None else len(logprobs)}")
        self.response_ids.extend(ids)
        self.loss_mask.extend([1 if trainable else 0] * len(ids))
        self.rollout_logprobs.extend(logprobs if trainable else [0.0] * len(ids))
        if weight_versions is not None and len(weight_versions) != len(ids):
            raise ValueError(f"append_tokens: {len(ids)} tokens but {len(weight_versions)} weight_versions")
        self.weight_versions.extend(weight_versions if weight_versions is not None else [NO_WEIGHT_VERSION] * len(ids))

    def validate(self) -> Sample:
        """Raise ValueError naming the first per-token field whose length differs from response_ids."""
        n = len(self.response_ids)
        for name in ("loss_mask", "rollout_logprobs", "weight_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"sample {self.index}: {name} has {len(getattr(self, name))} entries, "
                                 f"response_ids has {n}")
        if self.indexer_topk is not None:
            start = self.topk_first_row
            rows = len(self.prompt_ids) + n - 1 - start
            if start < 0 or self.indexer_topk.ndim != 3 or self.indexer_topk.shape[0] != rows:
                raise ValueError(f"sample {self.index}: indexer_topk covers sequence rows {start} .. P+R-2 and must have "
                                 f"shape ({rows}, n_full_layers, index_topk), got {self.indexer_topk.shape}")
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != n:
            raise ValueError(f"sample {self.index}: teacher_logprobs has {len(self.teacher_logprobs)} entries, "
                             f"response_ids has {n}")
        for name in ("teacher_topk_ids", "teacher_topk_logprobs"):
            value = getattr(self, name)
            if value is not None and (value.ndim != 2 or value.shape[0] != n):
                raise ValueError(f"sample {self.index}: {name} must have shape ({n}, k), got {value.shape}")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError(f"sample {self.index}: loss_mask entries must be 0 or 1")
        return self

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (arrays as nested lists, status as its string)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["status"] = self.status.value
        for name in ("indexer_topk", "teacher_topk_ids", "teacher_topk_logprobs"):
            out[name] = None if getattr(self, name) is None else getattr(self, name).tolist()
        for name in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "weight_versions"):
            out[name] = list(out[name])
        out["metadata"] = dict(self.metadata)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """Inverse of to_dict; an unknown key is an error that names it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Sample.from_dict: unknown field {unknown[0]!r}; expected some of {sorted(known)}")
        if "prompt_ids" not in data:
            raise ValueError("Sample.from_dict: missing field 'prompt_ids'")
        return cls(**data)
