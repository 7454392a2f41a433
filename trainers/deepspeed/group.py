"""The DeepSpeed backend's trainer group: DeepSpeedWorker ranks as Ray actors (registered as trainer.backend deepspeed)."""

from __future__ import annotations

from trainers.deepspeed.worker import DeepSpeedWorker
from trainers.group import RayTrainerGroup


class DeepSpeedTrainerGroup(RayTrainerGroup):
    """DeepSpeed ZeRO ranks (trainer.deepspeed: stage, offload)."""

    rank_class = DeepSpeedWorker
