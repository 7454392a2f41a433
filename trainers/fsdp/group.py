"""The FSDP2 backend's trainer group: FSDPWorker ranks as Ray actors (registered as trainer.backend fsdp)."""

from __future__ import annotations

from trainers.fsdp.worker import FSDPWorker
from trainers.group import RayTrainerGroup


class FSDPTrainerGroup(RayTrainerGroup):
    """FSDP2 ranks (or float32 replicas, trainer.data_parallel replicate)."""

    rank_class = FSDPWorker
