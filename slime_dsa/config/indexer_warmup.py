"""What `slime-dsa indexer-warmup` reads of a recipe. It trains only the indexers, in one CPU process, in float32, with
an optimizer and a step count of its own (indexer_warmup.*): a value other than the default of a key it does not read
is refused (`slime-dsa indexer-warmup`, and `recipe check --for indexer-warmup`) rather than ignored.

indexer-warmup reads model.path, preset, index_topk and tokenizer_path, data.* (the tasks corpus; with
indexer_warmup.corpus dataset it reads no data.* key, and refuses them set), indexer_warmup.*,
trainer.seed and max_grad_norm, and logging.run_dir, project, run_name, wandb_mode and log_every. It computes in
float32 on the CPU: model.dtype float32 or auto (float32 on a CPU) pass, bfloat16 is refused. The other RL keys
(rollout.*, algorithm.*, critic.*, teachers) and sft.* belong to the commands the same recipe may also serve.
"""

from __future__ import annotations

from slime_dsa.config.errors import raise_first_problem
from slime_dsa.config.schema import RecipeConfig
from slime_dsa.config.sft import unread_key_problems

ONE_PROCESS = "slime-dsa indexer-warmup trains the indexers in one process"
OWN_OPTIMIZER = "the warm-up's AdamW has no weight decay and a constant indexer_warmup.learning_rate; leave it unset"
# key -> what to do instead, for the keys indexer-warmup does not read; a section name stands for each of its keys.
NOT_READ_BY_INDEXER_WARMUP: dict[str, str] = {
    "model.ops_backend": "slime-dsa indexer-warmup runs the torch reference ops; leave it auto",
    "model.gradient_checkpointing": "slime-dsa indexer-warmup does not read it (only the indexers train); leave it "
                                    "unset",
    "model.true_on_policy": "slime-dsa indexer-warmup samples nothing; leave it unset",
    "trainer.backend": f"{ONE_PROCESS}; leave fsdp",
    "trainer.num_workers": f"{ONE_PROCESS}; leave 1",
    "trainer.data_parallel": f"{ONE_PROCESS}; leave fsdp",
    "trainer.learning_rate": "slime-dsa indexer-warmup's learning rate is indexer_warmup.learning_rate; set that",
    "trainer.num_steps": "slime-dsa indexer-warmup takes indexer_warmup.num_steps steps; set that",
    "trainer.micro_batch_tokens": "slime-dsa indexer-warmup packs indexer_warmup.batch_size windows of "
                                  "indexer_warmup.seq_len tokens into one forward; set those",
    "trainer.num_steps_per_rollout": "slime-dsa indexer-warmup has no rollouts; leave 1",
    "trainer.weight_decay": OWN_OPTIMIZER,
    "trainer.adam_betas": OWN_OPTIMIZER,
    "trainer.warmup_steps": OWN_OPTIMIZER,
    "trainer.lr_schedule": OWN_OPTIMIZER,
    "trainer.mixed_precision": "slime-dsa indexer-warmup computes in float32; leave it unset",
    "trainer.compile": "slime-dsa indexer-warmup runs its model eagerly; leave it unset",
    "trainer.share_prompt_prefix": "slime-dsa indexer-warmup trains on text windows, not groups of samples; leave "
                                   "it unset",
    "trainer.logprob_diff_warn_threshold": "slime-dsa indexer-warmup samples nothing; leave it unset",
    "trainer.megatron": f"{ONE_PROCESS}; leave trainer.megatron unset",
    "trainer.deepspeed": f"{ONE_PROCESS}; leave trainer.deepspeed unset",
    "cluster": f"{ONE_PROCESS}, without Ray; leave cluster.* unset",
    "checkpoint": "slime-dsa indexer-warmup writes no training checkpoints (it writes the model to "
                  "indexer_warmup.output_dir); leave checkpoint.* unset",
    "logging.eval_every": "slime-dsa indexer-warmup evaluates every indexer_warmup.eval_every steps; set that",
    "logging.eval_at_start": "slime-dsa indexer-warmup evaluates before its first step always; leave it unset",
    "logging.profile_steps": "slime-dsa indexer-warmup records no profile; leave it unset",
    "logging.profile_activities": "slime-dsa indexer-warmup records no profile; leave it unset",
    "logging.peak_tflops": "slime-dsa indexer-warmup logs no MFU; leave it unset",
}

DATASET_CORPUS = ("indexer_warmup.corpus 'dataset' trains on the text of indexer_warmup.dataset_path, not on data.*; "
                  "leave data.* unset or set corpus tasks")


def check_indexer_warmup_keys(config: RecipeConfig) -> None:
    """RecipeError for the first key indexer-warmup would ignore (naming how many more there are); none: return."""
    problems = unread_key_problems(config, NOT_READ_BY_INDEXER_WARMUP)
    if config.model.dtype == "bfloat16":
        problems.append(("model.dtype", "model.dtype 'bfloat16': slime-dsa indexer-warmup computes in float32 on the "
                                        "CPU (not built for GPUs yet); set float32 or auto"))
    if config.indexer_warmup.corpus == "dataset":
        names = ", ".join(t.name or t.kind for t in config.data.tasks)  # not the TaskConfig objects' repr
        problems += [(key, f"data.tasks [{names}]: {DATASET_CORPUS}" if key == "data.tasks" else message)
                     for key, message in unread_key_problems(config, {"data": DATASET_CORPUS})]
    raise_first_problem(problems)


def indexer_warmup_summary(config: RecipeConfig) -> str:
    """One line that says what `slime-dsa indexer-warmup` trains with this recipe, on what, and how."""
    iw = config.indexer_warmup
    topk = iw.index_topk if iw.index_topk is not None else "the model's"
    return (f"{config.model.source} | corpus: {iw.corpus} | "
            f"{iw.batch_size} windows of {iw.seq_len} tokens/step | index_topk {topk} | {iw.num_steps} steps")
