"""What `slime-dsa sft` reads of a recipe. It trains in one process, without Ray, on the GPU when there is one: the
recipe keys that size, place or checkpoint `train`'s trainer workers mean nothing to it. A value of such a key other
than its default is refused (`slime-dsa sft`, and `recipe check --for sft`) rather than ignored.

sft reads model.* but true_on_policy (an RL key), data.*, sft.*, rollout.max_response_length, rollout.stop and
rollout.reward_timeout_s (its evaluation), logging.run_dir, project, run_name, wandb_mode and log_every, and of
trainer.*: learning_rate, weight_decay, adam_betas, warmup_steps, lr_schedule, max_grad_norm, micro_batch_tokens,
mixed_precision (a GPU's bf16 autocast, as model.dtype bfloat16 or auto there; on a CPU it computes in float32,
and `slime-dsa sft` refuses model.dtype bfloat16), num_steps (optimizer steps) and seed.
trainer.share_prompt_prefix changes nothing there (sft packs each example whole: it has no groups of samples of one
prompt). The other RL keys (rollout.*, algorithm.*, critic.*, teachers) belong to the RL run that the same recipe
may also serve.
"""

from __future__ import annotations

from operator import attrgetter

from pydantic import BaseModel

from slime_dsa.config.errors import raise_first_problem
from slime_dsa.config.loader import show_value
from slime_dsa.config.schema import RecipeConfig

ONE_PROCESS = "slime-dsa sft trains in one process with the built-in trainer"
# key -> what to do instead, for the keys sft does not read; a section name stands for each of its keys.
NOT_READ_BY_SFT: dict[str, str] = {
    "model.true_on_policy": "slime-dsa sft samples nothing whose log-probs the trainer's must equal; leave it unset",
    "trainer.backend": f"{ONE_PROCESS}; use fsdp or run train",
    "trainer.num_workers": f"{ONE_PROCESS}; set 1 or run train",
    "trainer.data_parallel": f"{ONE_PROCESS}, which splits nothing; leave fsdp or run train",
    "trainer.compile": "slime-dsa sft runs its model eagerly (trainer.compile is the fsdp trainer's); leave it unset",
    "trainer.num_steps_per_rollout": "slime-dsa sft takes one optimizer step per trainer.num_steps (it has no "
                                     "rollouts); leave 1",
    "trainer.logprob_diff_warn_threshold": "slime-dsa sft samples nothing, so it has no rollout log-probs to compare; "
                                           "leave it unset",
    "cluster": f"{ONE_PROCESS}, without Ray (on the GPU when there is one); leave cluster.* unset or run train",
    "checkpoint": "slime-dsa sft writes no training checkpoints and cannot resume (it writes the final model to "
                  "sft.output_dir); leave checkpoint.* unset",
    "logging.eval_every": "slime-dsa sft evaluates every sft.eval_every steps; set that instead",
    "logging.eval_at_start": "slime-dsa sft evaluates every sft.eval_every steps and after the last; leave it unset",
    "logging.profile_steps": "slime-dsa sft records no profile; leave it unset",
    "logging.profile_activities": "slime-dsa sft records no profile; leave it unset",
    "logging.peak_tflops": "slime-dsa sft logs no MFU; leave it unset",
}


def sft_problems(config: RecipeConfig) -> list[tuple[str, str]]:
    """(key, one line) for every key set to a value sft would not honour, in NOT_READ_BY_SFT's order."""
    return unread_key_problems(config, NOT_READ_BY_SFT)


def unread_key_problems(config: RecipeConfig, not_read: dict[str, str]) -> list[tuple[str, str]]:
    """(key, one line) for every key of `not_read` (key or section -> what to do instead) set away from its default,
    in its order: a command's keys it would not honour (sft here, indexer-warmup)."""
    defaults = RecipeConfig()
    problems = []
    for name, advice in not_read.items():
        for key in _keys(defaults, name):
            value = attrgetter(key)(config)
            if value != attrgetter(key)(defaults):
                problems.append((key, f"{key} {show_value(value)}: {advice}"))
    return problems


def check_sft_keys(config: RecipeConfig) -> None:
    """RecipeError for the first key sft would ignore (naming how many more there are); none: return."""
    raise_first_problem(sft_problems(config))


def sft_summary(config: RecipeConfig) -> str:
    """One line that says what `slime-dsa sft` trains with this recipe, on what, and how."""
    tasks = ", ".join(f"{t.name}×{t.weight:g}" for t in config.data.tasks)
    tr, sft = config.trainer, config.sft
    return (f"{config.model.source} | tasks: {tasks} | {sft.batch_size} "
            f"examples/step in micro-batches of at most {tr.micro_batch_tokens} tokens | {tr.num_steps} steps")


def _keys(config: RecipeConfig, name: str) -> list[str]:
    """The dotted key `name`, or each key of the section `name`."""
    value = attrgetter(name)(config)
    return [f"{name}.{k}" for k in type(value).model_fields] if isinstance(value, BaseModel) else [name]
