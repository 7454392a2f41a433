"""Roles placed apart: one trainer group per placement behind the TrainerGroup interface. Each call goes to the
group holding its role (the policy's weights to engines from the policy's group); checkpoints and memory calls
reach every group, and the groups' files do not collide (trainers/fsdp/checkpointing.py: a group writes under its
first role's directory)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from slime_dsa.weights.payloads import TensorSpec
from trainers.base import TrainBatch, TrainerGroup


class RoleGroups:
    """Trainer groups by role, e.g. {"policy": the policy's ranks, "critic": the critic's own ranks}."""

    def __init__(self, groups: dict[str, TrainerGroup]) -> None:
        if "policy" not in groups:
            raise ValueError(f"RoleGroups needs the policy's group, got roles {sorted(groups)}")
        self.groups = groups
        self._distinct = list({id(g): g for g in groups.values()}.values())

    @property
    def world_size(self) -> int:
        return self.groups["policy"].world_size

    @property
    def workers(self) -> list:
        """Every rank actor of every group (for pinning to cores)."""
        return [w for g in self._distinct for w in g.workers]

    def _group(self, role: str) -> TrainerGroup:
        if role not in self.groups:
            raise ValueError(f"no trainer group holds role {role!r}; roles: {', '.join(self.groups)}")
        return self.groups[role]

    def train(self, batch: TrainBatch, num_mini_batches: int = 1, recompute_old_logprobs: bool = False,
              detailed_metrics: bool = True, role: str = "policy",
              on_sent: Callable[[], None] | None = None) -> tuple[torch.Tensor | None, dict[str, float]]:
        return self._group(role).train(batch, num_mini_batches, recompute_old_logprobs, detailed_metrics, role, on_sent)

    def compute_logprobs(self, batch: TrainBatch, role: str = "policy") -> torch.Tensor:
        return self._group(role).compute_logprobs(batch, role)

    def compute_values(self, batch: TrainBatch, role: str = "critic") -> tuple[torch.Tensor, torch.Tensor]:
        return self._group(role).compute_values(batch, role)

    def full_state_dict(self, role: str = "policy") -> dict[str, torch.Tensor]:
        return self._group(role).full_state_dict(role)

    def save_weights(self, path: str, role: str = "policy") -> None:
        self._group(role).save_weights(path, role)

    # -- the policy's weights to the engines ----------------------------------------------------

    def share_weights(self, engine_dtype: str) -> dict:
        return self.groups["policy"].share_weights(engine_dtype)

    def weight_buckets(self, engine_dtype: str | None, bucket_bytes: int) -> list[list[TensorSpec]]:
        return self.groups["policy"].weight_buckets(engine_dtype, bucket_bytes)

    def weight_group_address(self) -> tuple[str, int]:
        return self.groups["policy"].weight_group_address()

    def join_weight_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                          backend: str) -> None:
        self.groups["policy"].join_weight_group(master_address, master_port, world_size, group_name, backend)

    def broadcast_weights(self, buckets: list[list[TensorSpec]]) -> None:
        self.groups["policy"].broadcast_weights(buckets)

    def cuda_device(self) -> str | None:
        return self.groups["policy"].cuda_device()

    def node_id(self) -> str | None:
        return self.groups["policy"].node_id()

    # -- every group ------------------------------------------------------------------------------

    def save_checkpoint(self, directory: str) -> None:
        for group in self._distinct:
            group.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> None:
        for group in self._distinct:
            group.load_checkpoint(directory)

    def release_memory(self, min_free_share: float | None = None) -> None:
        for group in self._distinct:
            group.release_memory(min_free_share)

    def resume_memory(self) -> None:
        for group in self._distinct:
            group.resume_memory()

    def shutdown(self) -> None:
        for group in self._distinct:
            group.shutdown()
