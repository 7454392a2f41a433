"""The backend-neutral trainer interface and the packed batch it consumes.

The orchestrator speaks only to this interface; FSDP2 is the default backend, Megatron and DeepSpeed plug in
behind the same methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from slime_dsa.weights.payloads import TensorSpec


@dataclass
class TrainBatch:
    """Samples for one rank, packed: every per-token tensor has shape (T,) over prompt+response tokens.

    Row t of `rollout_logprobs` / `advantages` / `loss_mask` describes token t (its log-prob given the tokens
    before it); prompt rows have loss_mask 0.
    """

    input_ids: torch.Tensor  # (T,) long
    seqlens: list[int]  # tokens per sample, in order
    loss_mask: torch.Tensor  # (T,) float, 1 on generated tokens the policy is trained on
    rollout_logprobs: torch.Tensor  # (T,) float32, log π_roll of each token (0 on prompt)
    advantages: torch.Tensor  # (T,) float32, advantage broadcast to the sample's tokens
    old_logprobs: torch.Tensor | None = None  # (T,) log π_old, filled by compute_logprobs unless bypass mode
    ref_logprobs: torch.Tensor | None = None  # (T,) for the optional KL term
    replay_topk: torch.Tensor | None = None  # (n_full_layers, T, K) index replay, -1 padded, REPLAY_COMPUTE rows computed
    rollout_topk: torch.Tensor | None = None  # same layout: the engine's selection, only compared (mismatch metric)
    prompt_lens: list[int] | None = None  # prompt tokens per sample: lets consecutive samples share their prompt
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def select(self, sample_ids: list[int]) -> "TrainBatch":
        """The sub-batch of the given samples (in that order)."""
        starts = [0]
        for n in self.seqlens:
            starts.append(starts[-1] + n)
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in sample_ids]) if sample_ids else torch.zeros(0, dtype=torch.long)

        def take(t: torch.Tensor | None, dim: int = 0) -> torch.Tensor | None:
            return None if t is None else t.index_select(dim, rows)

        return TrainBatch(
            input_ids=take(self.input_ids), seqlens=[self.seqlens[i] for i in sample_ids],
            loss_mask=take(self.loss_mask), rollout_logprobs=take(self.rollout_logprobs), advantages=take(self.advantages),
            old_logprobs=take(self.old_logprobs), ref_logprobs=take(self.ref_logprobs),
            replay_topk=take(self.replay_topk, dim=1), rollout_topk=take(self.rollout_topk, dim=1),
            prompt_lens=None if self.prompt_lens is None else [self.prompt_lens[i] for i in sample_ids], extra=self.extra,
        )


def split_by_tokens(seqlens: list[int], max_tokens: int, shared: list[int] | None = None) -> list[list[int]]:
    """Greedy packing of samples (in order) into groups of at most max_tokens (a longer sample stands alone).

    shared[i]: leading tokens sample i shares with sample i - 1; computed once when both are in one group, so
    they cost nothing there (shared-prompt packing).
    """
    groups, current, size = [], [], 0
    for i, n in enumerate(seqlens):
        cost = n - shared[i] if shared and current else n
        if current and size + cost > max_tokens:
            groups.append(current)
            current, size, cost = [], 0, n
        current.append(i)
        size += cost
    if current:
        groups.append(current)
    return groups


def balance_across_ranks(seqlens: list[int], world_size: int, shared: list[int] | None = None) -> list[list[int]]:
    """Assign samples to ranks so that the rows each computes are balanced (largest first onto the lightest rank).

    shared[i] (as in split_by_tokens): leading tokens sample i shares with sample i - 1. A run of samples that
    share their prompt stays on one rank, which computes the prompt once, unless the run alone exceeds a rank's
    fair share of the rows: then it is cut into that many pieces, each computing the prompt again.
    """
    shared = shared or [0] * len(seqlens)
    runs: list[list[int]] = []
    for i in range(len(seqlens)):
        if runs and shared[i] > 0:
            runs[-1].append(i)
        else:
            runs.append([i])

    def rows(piece: list[int]) -> int:
        return seqlens[piece[0]] + sum(seqlens[i] - shared[i] for i in piece[1:])

    fair = max(sum(rows(run) for run in runs) / world_size, 1.0)
    pieces: list[list[int]] = []
    for run in runs:
        cuts = min(len(run), -(-rows(run) // int(fair)) if rows(run) > fair else 1)
        pieces += [run[j * len(run) // cuts : (j + 1) * len(run) // cuts] for j in range(cuts)]
    loads = [0] * world_size
    assignment: list[list[int]] = [[] for _ in range(world_size)]
    for piece in sorted(pieces, key=lambda p: -rows(p)):
        rank = loads.index(min(loads))
        assignment[rank].extend(piece)
        loads[rank] += rows(piece)
    return [sorted(a) for a in assignment]


class TrainerBackend(Protocol):
    """What every training backend offers, per rank; a TrainerGroup fans calls out to all ranks."""

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor: ...

    def train_step(self, batch: TrainBatch, global_loss_tokens: float, global_num_samples: int,
                   detailed_metrics: bool = True) -> dict[str, float]: ...

    def train_batches(self, shards: list[TrainBatch], totals: list[tuple[float, int]],
                      recompute_old_logprobs: bool = False, detailed_metrics: bool = True) -> tuple[list[torch.Tensor] | None, list[dict[str, float]]]: ...

    def full_state_dict(self) -> dict[str, torch.Tensor] | None: ...

    def save_weights(self, path: str) -> None: ...

    def share_weights(self, engine_dtype: str) -> dict | None: ...

    def weight_buckets(self, engine_dtype: str | None, bucket_bytes: int) -> list[list[TensorSpec]]: ...

    def weight_group_address(self) -> tuple[str, int]: ...

    def join_weight_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                          backend: str) -> None: ...

    def broadcast_weights(self, buckets: list[list[TensorSpec]]) -> None: ...

    def cuda_device(self) -> str | None: ...

    def save_checkpoint(self, directory: str) -> None: ...

    def load_checkpoint(self, directory: str) -> None: ...
