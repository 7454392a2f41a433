"""Which tensor / expert / pipeline / context parallel sizes a GLM-MoE-DSA shape allows, and IndexShare-aware
pipeline stages. Pure arithmetic on the config: `recipe check` and the Megatron backend both ask it."""

from __future__ import annotations

from dataclasses import dataclass

from slime_dsa.models.config import ModelConfig

KEY = "trainer.megatron"


@dataclass(frozen=True)
class ParallelSizes:
    """Model-parallel sizes; data parallel is what remains of the world."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    context_parallel: int = 1

    def data_parallel(self, world_size: int) -> int:
        return world_size // (self.tensor_parallel * self.pipeline_parallel * self.context_parallel)


def pipeline_stages(indexer_types: list[str], stages: int) -> list[range]:
    """Layers per pipeline stage, as even as possible, each stage starting on a layer that runs its own indexer
    ('full'): a 'shared' layer reuses the top-k of the layer before it, which must then sit on the same stage.
    Raises ValueError when the IndexShare pattern has fewer full layers than stages."""
    full = [i for i, t in enumerate(indexer_types) if t == "full"]
    if stages > len(full):
        raise ValueError(f"{KEY}.pipeline_parallel ({stages}) exceeds the {len(full)} layers that compute their own "
                         "indexer: every stage must begin on one")
    n = len(indexer_types)
    starts = [0]
    for s in range(1, stages):
        ideal = s * n / stages
        # the full layer nearest the even cut that keeps starts increasing and leaves one full layer per later stage
        options = [i for i in full if i > starts[-1] and len([j for j in full if j >= i]) >= stages - s]
        starts.append(min(options, key=lambda i: (abs(i - ideal), i)))
    return [range(a, b) for a, b in zip(starts, starts[1:] + [n])]


def check_parallel_sizes(config: ModelConfig, sizes: ParallelSizes, world_size: int) -> None:
    """Raise ValueError (one line, naming the key) when the sizes do not divide the model or the world."""
    tp, pp, ep, cp = sizes.tensor_parallel, sizes.pipeline_parallel, sizes.expert_parallel, sizes.context_parallel
    if world_size % (tp * pp * cp):
        raise ValueError(f"trainer.num_workers ({world_size}) must be a multiple of {KEY}.tensor_parallel × "
                         f"pipeline_parallel × context_parallel ({tp * pp * cp})")
    if world_size % (ep * pp):
        raise ValueError(f"trainer.num_workers ({world_size}) must be a multiple of {KEY}.expert_parallel × "
                         f"pipeline_parallel ({ep * pp})")
    shared = config.moe_intermediate_size * config.n_shared_experts
    for name, value in (("num_attention_heads", config.num_attention_heads), ("vocab_size", config.vocab_size),
                        ("intermediate_size", config.intermediate_size),
                        ("moe_intermediate_size × n_shared_experts", shared)):
        if value % tp:
            raise ValueError(f"{KEY}.tensor_parallel ({tp}) must divide the model's {name} ({value})")
    if config.n_routed_experts % ep:
        raise ValueError(f"{KEY}.expert_parallel ({ep}) must divide the model's n_routed_experts "
                         f"({config.n_routed_experts})")
    if tp > 1 and config.attention_bias:
        raise ValueError(f"{KEY}.tensor_parallel ({tp}) > 1 needs attention_bias false (sequence parallelism)")
    if pp > 1:
        pipeline_stages(config.indexer_types, pp)
        if config.num_hidden_layers < pp:
            raise ValueError(f"{KEY}.pipeline_parallel ({pp}) exceeds num_hidden_layers ({config.num_hidden_layers})")
