"""Megatron's process groups for a rank: initialise model parallelism from the recipe's sizes and say where this
rank sits (data-parallel rank and size, tensor- and expert-parallel rank)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from slime_dsa.models.parallel_layout import KEY, ParallelSizes


@dataclass(frozen=True)
class RankPlace:
    """Where a rank sits in the model-parallel grid."""

    tp_rank: int
    ep_rank: int
    dp_rank: int
    dp_size: int


def parallel_sizes(options: dict) -> ParallelSizes:
    """The recipe's trainer.megatron section as ParallelSizes; refuses (one line) what this backend does not build."""
    sizes = ParallelSizes(**options)
    if sizes.pipeline_parallel > 1:
        raise ValueError(f"{KEY}.pipeline_parallel ({sizes.pipeline_parallel}) > 1 is not built yet: the shared step "
                         "runs micro-batches itself, not megatron's pipeline schedule")
    if sizes.context_parallel > 1:
        raise ValueError(f"{KEY}.context_parallel ({sizes.context_parallel}) > 1 is not built yet")
    return sizes


def initialize(sizes: ParallelSizes) -> tuple[ProcessGroupCollection, RankPlace]:
    """Build megatron's groups over the initialised default group (experts split by EP only: expert TP is 1)."""
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=sizes.tensor_parallel, pipeline_model_parallel_size=sizes.pipeline_parallel,
            context_parallel_size=sizes.context_parallel, expert_model_parallel_size=sizes.expert_parallel,
            expert_tensor_parallel_size=1)
    place = RankPlace(tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                      ep_rank=parallel_state.get_expert_model_parallel_rank(),
                      dp_rank=parallel_state.get_data_parallel_rank(),
                      dp_size=parallel_state.get_data_parallel_world_size())
    return ProcessGroupCollection.use_mpu_process_groups(), place
