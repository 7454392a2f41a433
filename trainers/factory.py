"""From a recipe to a running trainer group: the backend named by trainer.backend, built from one typed RankConfig."""

from __future__ import annotations

from pathlib import Path

from slime_dsa.algorithms.specs import Algorithm
from slime_dsa.config import RecipeConfig
from slime_dsa.config.plugins import import_object
from slime_dsa.config.schema import TRAINER_BACKENDS
from trainers.base import DSAOptions, OptimizerConfig, RankConfig, RoleConfig, TrainerGroup


def rank_config(recipe: RecipeConfig, model_dir: Path, algorithm: Algorithm) -> RankConfig:
    """The ranks' config: the roles the algorithm needs (the policy today), with its loss, and the recipe's trainer."""
    tr, alg = recipe.trainer, recipe.algorithm
    if algorithm.roles != ("policy",):
        raise ValueError(f"algorithm {algorithm.name!r} needs roles {algorithm.roles}; only the policy is built")
    optimizer = OptimizerConfig(
        learning_rate=tr.learning_rate, weight_decay=tr.weight_decay, adam_betas=tuple(tr.adam_betas),
        warmup_steps=tr.warmup_steps, total_steps=tr.num_steps * tr.num_steps_per_rollout,
        lr_schedule=tr.lr_schedule, max_grad_norm=tr.max_grad_norm)
    dsa = DSAOptions(indexer_loss_coef=alg.indexer_loss_coef, indexer_stage=alg.indexer_loss_stage,
                     indexer_target=alg.indexer_loss_target, indexer_learning_rate=alg.indexer_learning_rate,
                     index_replay=alg.index_replay)
    frozen = (".indexer.",) if alg.freeze_indexer or alg.indexer_loss_coef == 0 else ()
    policy = RoleConfig(str(model_dir), optimizer, algorithm.policy_loss(), frozen, dsa)
    return RankConfig(
        roles={"policy": policy}, micro_batch_tokens=tr.micro_batch_tokens, mixed_precision=tr.mixed_precision,
        gradient_checkpointing=recipe.model.gradient_checkpointing, ops_backend=recipe.model.ops_backend,
        temperature=recipe.rollout.temperature or 1.0, seed=tr.seed, share_prompt_prefix=tr.share_prompt_prefix,
        data_parallel=tr.data_parallel)


def build_trainer_group(recipe: RecipeConfig, model_dir: Path, algorithm: Algorithm) -> TrainerGroup:
    """Start the ranks of the recipe's backend (trainer.backend) on the Ray cluster."""
    group_class = import_object(TRAINER_BACKENDS[recipe.trainer.backend], "trainer backend")
    return group_class(rank_config(recipe, model_dir, algorithm), recipe.trainer.num_workers,
                       num_cpus_per_worker=recipe.cluster.num_cpus_per_actor,
                       num_gpus_per_worker=recipe.cluster.num_gpus_per_trainer)
