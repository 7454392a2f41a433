"""From a recipe to a running trainer group: the backend named by trainer.backend, built from one typed RankConfig
per group. The roles come from the algorithm: the policy, and a critic where it has one (colocated in the policy's
ranks, or in a group of its own: critic.placement)."""

from __future__ import annotations

from pathlib import Path

from slime_dsa.algorithms.specs import Algorithm
from slime_dsa.config import RecipeConfig
from slime_dsa.config.plugins import import_object
from slime_dsa.config.schema import TRAINER_BACKENDS
from slime_dsa.models.value_model import VALUE_FROZEN
from trainers.base import DSAOptions, OptimizerConfig, RankConfig, RoleConfig, TrainerGroup

BUILT_ROLES = ("policy", "critic")


def role_configs(recipe: RecipeConfig, model_dir: Path, algorithm: Algorithm) -> dict[str, RoleConfig]:
    """Every role the algorithm needs: the policy with its loss, and the critic (a value model) with its own."""
    tr, alg = recipe.trainer, recipe.algorithm
    missing = [r for r in algorithm.roles if r not in BUILT_ROLES]
    if missing:
        raise ValueError(f"algorithm {algorithm.name!r} needs roles {algorithm.roles}; {', '.join(missing)} not built")
    policy_steps = sum(algorithm.trains_policy(step) for step in range(tr.num_steps))  # a critic warm-up trains none
    optimizer = OptimizerConfig(
        learning_rate=tr.learning_rate, weight_decay=tr.weight_decay, adam_betas=tuple(tr.adam_betas),
        warmup_steps=tr.warmup_steps, total_steps=max(policy_steps, 1) * tr.num_steps_per_rollout,
        lr_schedule=tr.lr_schedule, max_grad_norm=tr.max_grad_norm)
    dsa = DSAOptions(indexer_loss_coef=alg.indexer_loss_coef, indexer_stage=alg.indexer_loss_stage,
                     indexer_target=alg.indexer_loss_target, indexer_learning_rate=alg.indexer_learning_rate,
                     index_replay=alg.index_replay)
    frozen = (".indexer.",) if alg.freeze_indexer or alg.indexer_loss_coef == 0 else ()
    roles = {"policy": RoleConfig(str(model_dir), optimizer, algorithm.policy_loss(), frozen, dsa)}
    if "critic" in algorithm.roles:
        cr = recipe.critic
        critic_optimizer = OptimizerConfig(
            learning_rate=cr.learning_rate, weight_decay=cr.weight_decay, adam_betas=tuple(tr.adam_betas),
            total_steps=tr.num_steps * tr.num_steps_per_rollout * algorithm.critic_updates_per_step,
            lr_schedule="constant", max_grad_norm=cr.max_grad_norm)
        roles["critic"] = RoleConfig(cr.path or str(model_dir), critic_optimizer, algorithm.value_loss(), VALUE_FROZEN,
                                     kind="value")
    return roles


def rank_config(recipe: RecipeConfig, model_dir: Path, algorithm: Algorithm,
                roles: tuple[str, ...] | None = None) -> RankConfig:
    """The ranks' config: the algorithm's roles (or only `roles` of them) and the recipe's trainer."""
    tr = recipe.trainer
    every = role_configs(recipe, model_dir, algorithm)
    held = {name: every[name] for name in (roles or tuple(every))}
    return RankConfig(
        roles=held, micro_batch_tokens=tr.micro_batch_tokens, mixed_precision=tr.mixed_precision,
        gradient_checkpointing=recipe.model.gradient_checkpointing, compile=tr.compile,
        ops_backend=recipe.model.ops_backend,
        true_on_policy=recipe.model.true_on_policy, temperature=recipe.rollout.temperature or 1.0, seed=tr.seed, share_prompt_prefix=tr.share_prompt_prefix,
        data_parallel=tr.data_parallel, backend_options=tr.backend_options(),
        warmup_max_len=recipe.data.max_prompt_length + recipe.rollout.max_response_length)


def build_trainer_group(recipe: RecipeConfig, model_dir: Path, algorithm: Algorithm) -> TrainerGroup:
    """Start the ranks of the recipe's backend (trainer.backend) on the Ray cluster: one group, or with a critic
    placed apart (critic.placement separate) one group per placement behind a RoleGroups."""
    group_class = import_object(TRAINER_BACKENDS[recipe.trainer.backend], "trainer backend")
    cl, tr = recipe.cluster, recipe.trainer
    if "critic" not in algorithm.roles or recipe.critic.placement == "colocated":
        return group_class(rank_config(recipe, model_dir, algorithm), tr.num_workers,
                           num_cpus_per_worker=cl.num_cpus_per_actor, num_gpus_per_worker=cl.num_gpus_per_trainer)
    from trainers.placement import RoleGroups  # noqa: PLC0415

    policy = group_class(rank_config(recipe, model_dir, algorithm, ("policy",)), tr.num_workers,
                         num_cpus_per_worker=cl.num_cpus_per_actor, num_gpus_per_worker=cl.num_gpus_per_trainer)
    critic = group_class(rank_config(recipe, model_dir, algorithm, ("critic",)), recipe.critic.num_workers,
                         num_cpus_per_worker=cl.num_cpus_per_actor,
                         num_gpus_per_worker=recipe.critic.num_gpus_per_worker)
    return RoleGroups({"policy": policy, "critic": critic})
