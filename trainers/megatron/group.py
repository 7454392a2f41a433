"""The Megatron backend's trainer group: MegatronWorker ranks as Ray actors (registered as trainer.backend megatron).
The batch is split over data-parallel ranks; tensor-parallel peers train on the same shard."""

from __future__ import annotations

from trainers.group import RayTrainerGroup
from trainers.megatron.worker import MegatronWorker


class MegatronTrainerGroup(RayTrainerGroup):
    """Megatron ranks: TP × EP (× DP) over num_workers, as trainer.megatron sets them."""

    rank_class = MegatronWorker
