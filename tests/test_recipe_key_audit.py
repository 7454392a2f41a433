"""Recipe keys that were accepted and then ignored (or refused only after Ray started) in some combination of
loop, engine and section: `recipe check` refuses each in one line naming the key."""

from __future__ import annotations

import pytest

from slime_dsa.config import RecipeError, validate_recipe

EXTERNAL = {"engine": "external", "engine_urls": ["http://127.0.0.1:30000"]}


def refusal(data: dict) -> str:
    """The one-line RecipeError that validate_recipe raises for `data`."""
    with pytest.raises(RecipeError) as info:
        validate_recipe(data)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_num_engines_with_external_engines_is_refused():
    """engine external uses one engine per URL: rollout.num_engines 4 was accepted and ignored."""
    message = refusal({"rollout": {**EXTERNAL, "num_engines": 4}})
    assert "rollout: num_engines (4) counts the engines the run starts" in message and "engine_urls" in message
    assert validate_recipe({"rollout": {**EXTERNAL}}).rollout.num_engines == 1


@pytest.mark.parametrize("key, value", [("oversample_factor", 1.5), ("max_oversample_factor", 2.0),
                                        ("max_sampling_tries", 8)])
def test_sampling_round_keys_under_the_asynchronous_loop_are_refused(key, value):
    """The asynchronous loop replaces each dropped group as it goes, in no rounds: these keys of the synchronous
    loop's dynamic-sampling rounds were accepted and ignored by async_reinforce."""
    data = {"rollout": {"dynamic_sampling": True, key: value}, "algorithm": {"name": "async_reinforce"}}
    message = refusal(data)
    assert f"rollout.{key} ({value}) sizes the synchronous loop's sampling rounds" in message
    assert "algorithm 'async_reinforce' runs the asynchronous one" in message
    assert validate_recipe({**data, "algorithm": {"name": "grpo"}}).rollout.dynamic_sampling  # the synchronous loop
    validate_recipe({**data, "rollout": {"dynamic_sampling": True}})  # dynamic sampling itself: both loops


@pytest.mark.parametrize("key, value", [("dataset_path", "corpus.jsonl"), ("dataset_split", "test"),
                                        ("text_column", "body")])
def test_indexer_warmup_dataset_keys_with_the_tasks_corpus_are_refused(key, value):
    """corpus tasks trains on data.tasks' prompts and solutions: a dataset_path (or its split, its column) was
    accepted and the warm-up ran on the tasks instead."""
    message = refusal({"indexer_warmup": {key: value}})
    assert message.startswith(f"indexer_warmup: {key} ('{value}') is only read by corpus 'dataset', but corpus is "
                              "'tasks'")
    validate_recipe({"indexer_warmup": {"corpus": "dataset", "dataset_path": "c.jsonl", key: value}})


@pytest.mark.parametrize("engine", [{"engine": "sglang"}, EXTERNAL])
def test_overlap_schedule_false_for_servers_is_refused(engine):
    """overlap_schedule false on SGLang or external servers was accepted and changed nothing (true was refused)."""
    data = {"rollout": {**engine, "overlap_schedule": False}, "cluster": {"num_gpus_per_engine": 1}}
    assert "rollout.overlap_schedule applies to embedded engines" in refusal(data)
    assert validate_recipe({**data, "rollout": {"overlap_schedule": False}}).rollout.overlap_schedule is False


def test_sglang_kv_cache_dtype_outside_the_launchers_choices_is_refused():
    """Any string was accepted; the launcher refused it only when starting the servers, a ValueError that named
    no recipe key. The schema's choices are the launcher's."""
    from typing import get_args

    from rollout.sglang.config import KV_CACHE_DTYPES
    from slime_dsa.config.schema import SGLangSection

    data = {"rollout": {"engine": "sglang", "sglang": {"kv_cache_dtype": "fp16"}},
            "cluster": {"num_gpus_per_engine": 1}}
    assert refusal(data).startswith("rollout.sglang.kv_cache_dtype: expected one of 'auto', 'bf16'")
    assert get_args(SGLangSection.model_fields["kv_cache_dtype"].annotation) == KV_CACHE_DTYPES


def _agent_task(**agent) -> dict:
    return {"data": {"tasks": [{"kind": "calc_chain", "agent": agent}], "apply_chat_template": True}}


@pytest.mark.parametrize("agent", [
    {"tools": ["calculator", "my_pkg.tools:Lookup"], "tool_isolation": "inline", "tool_workers": 4},
    {"tools": ["calculator", "python"], "tool_workers": 4},  # no tool by import path: the built-in ones have no workers
])
def test_tool_workers_without_worker_processes_is_refused(agent):
    """tool_workers sizes the worker processes of tools by import path (tool_isolation process); with inline, or
    with only built-in tools, it was accepted and no worker ran."""
    message = refusal(_agent_task(**agent))
    assert message.startswith("data.tasks.0.agent: tool_workers (4) applies to tools by import path run with "
                              "tool_isolation 'process'")
    validate_recipe(_agent_task(tools=["calculator", "my_pkg.tools:Lookup"], tool_workers=4))


def test_tool_max_processes_without_the_python_tool_is_refused():
    """tool_max_processes limits the python tool's sandbox only; without that tool it was accepted and ignored."""
    message = refusal(_agent_task(tools=["calculator", "my_pkg.tools:Lookup"], tool_max_processes=2))
    assert message.startswith("data.tasks.0.agent: tool_max_processes (2) applies to the python tool")
    validate_recipe(_agent_task(tools=["calculator", "python"], tool_max_processes=2))


@pytest.mark.parametrize("data, why", [
    ({"rollout": {**EXTERNAL, "weight_sync": "cuda_ipc"},
      "cluster": {"num_gpus_per_engine": 1, "num_gpus_per_trainer": 1}},
     "needs embedded engines, not rollout.engine 'external'"),
    ({"rollout": {"weight_sync": "cuda_ipc"}}, "needs the engines and trainer rank 0 on one GPU: cluster."),
    ({"rollout": {"weight_sync": "cuda_ipc"}, "cluster": {"num_gpus_per_engine": 1}}, "on one GPU"),
])
def test_cuda_ipc_weight_sync_where_it_cannot_run_is_refused(data, why):
    """rollout.weight_sync cuda_ipc for external engines or CPU actors passed recipe check and failed after Ray and
    the engines had started."""
    message = refusal(data)
    assert message.startswith("rollout.weight_sync 'cuda_ipc' ") and why in message
    validate_recipe({"rollout": {"weight_sync": "cuda_ipc"},
                     "cluster": {"num_gpus_per_engine": 0.5, "num_gpus_per_trainer": 0.5}})


def test_a_task_args_value_of_no_accepted_type_names_its_key_and_the_types():
    """It was 'data.tasks.0.task_args: expected an integer, got [1]': the parameter unnamed and only the union's
    first type."""
    message = refusal({"data": {"tasks": [{"kind": "arithmetic", "task_args": {"max_digits": [1]}}]}})
    assert message == ("data.tasks.0.task_args.max_digits: expected an integer, a number, true or false or a string, "
                       "got [1]")


@pytest.mark.parametrize("key, value", [("max_oversample_factor", 2.0), ("max_sampling_tries", 8)])
def test_sampling_round_keys_without_dynamic_sampling_are_refused(key, value):
    """Without dynamic sampling a step is one round of prompts_per_step prompts: these keys were accepted and
    ignored (oversample_factor was already refused)."""
    message = refusal({"rollout": {key: value}})
    assert message.startswith(f"rollout: {key} ({value}) only applies with dynamic_sampling: true")
    validate_recipe({"rollout": {"dynamic_sampling": True, key: value}})


@pytest.mark.parametrize("correction, key, value", [("none", "icepop_alpha", 0.3), ("tis", "icepop_beta", 3.0),
                                                    ("none", "tis_cap", 3.0), ("icepop", "tis_cap", 3.0)])
def test_is_correction_keys_of_another_correction_are_refused(correction, key, value):
    """The policy loss gets icepop_alpha/beta only with is_correction icepop and tis_cap only with tis: the
    others were accepted and ignored."""
    message = refusal({"algorithm": {"is_correction": correction, key: value}})
    wanted = "tis" if key == "tis_cap" else "icepop"
    assert message.startswith(f"algorithm: {key} ({value}) only applies with is_correction: {wanted}")
    validate_recipe({"algorithm": {"is_correction": wanted, key: value}})


@pytest.mark.parametrize("key, value", [("indexer_learning_rate", 1e-3), ("indexer_loss_stage", "dense"),
                                        ("indexer_loss_target", "own")])
def test_indexer_loss_keys_without_the_indexer_loss_are_refused(key, value):
    """indexer_loss_coef 0 computes no indexer loss and freezes the indexers: these keys were accepted and
    ignored."""
    message = refusal({"algorithm": {key: value}})
    assert message.startswith(f"algorithm: {key} ({value!r}) applies to the indexer loss, which indexer_loss_coef 0")
    validate_recipe({"algorithm": {"indexer_loss_coef": 0.1, key: value}})


def test_freeze_indexer_is_refused_because_the_indexer_is_fixed_without_the_indexer_loss():
    """Only indexer_loss_coef > 0 trains the indexers (refused with freeze_indexer); at 0 they are frozen anyway,
    so freeze_indexer: true was accepted and changed nothing."""
    message = refusal({"algorithm": {"freeze_indexer": True}})
    assert message.startswith("algorithm: freeze_indexer (True) changes nothing: the indexers train only with "
                              "indexer_loss_coef > 0")


def test_train_size_of_a_dataset_task_is_refused(tmp_path):
    """kind dataset trains on the file's rows: train_size was accepted and ignored."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1", "answer": "2"}\n')
    message = refusal({"data": {"tasks": [{"kind": "dataset", "path": str(rows), "train_size": 5}]}})
    assert message.startswith("data.tasks.0: train_size (5) is only read by built-in kinds, but kind is 'dataset'")
    validate_recipe({"data": {"tasks": [{"kind": "calc_chain", "train_size": 5}], "apply_chat_template": True}})


def test_profile_activities_without_profile_steps_are_refused():
    """logging.profile_activities says what profile_steps records: without a step it was accepted and nothing was
    profiled."""
    message = refusal({"logging": {"profile_activities": ["GPU"]}})
    assert message.startswith("logging: profile_activities (['GPU']) applies with profile_steps, which lists no step")
    validate_recipe({"logging": {"profile_activities": ["GPU"], "profile_steps": [1]}})


def test_sft_stop_at_pass_without_evaluations_before_the_end_is_refused():
    """sft.eval_every 0 evaluates only after the last step, so stop_at_pass could never stop the run early: it was
    accepted and the run went on to trainer.num_steps."""
    held_out = {"tasks": [{"kind": "arithmetic", "eval_size": 8}]}
    message = refusal({"sft": {"stop_at_pass": 0.5, "eval_every": 0}, "data": held_out})
    assert message.startswith("sft: stop_at_pass (0.5) is checked at each evaluation, and eval_every 0 evaluates only "
                              "after the last step")
    validate_recipe({"sft": {"stop_at_pass": 0.5, "eval_every": 10}, "data": held_out})


@pytest.mark.parametrize("key, value", [("eval_every", 10), ("eval_prompts", 32)])
def test_sft_evaluation_keys_without_held_out_prompts_are_refused(key, value):
    """sft evaluates each task's eval split: with none (no eval_size or eval_fraction on any task), sft.eval_every and
    sft.eval_prompts were accepted and every evaluation scored no prompt, without a word (logging.eval_every, train's,
    and sft.stop_at_pass were already refused there). sft.eval_every 0 (at the end only) still passes."""
    message = refusal({"sft": {key: value}})
    assert message.startswith(f"sft.{key} ({value}) needs held-out prompts: set eval_size or eval_fraction on a task "
                              "in data.tasks"), message
    validate_recipe({"sft": {key: value}, "data": {"tasks": [{"kind": "arithmetic", "eval_size": 8}]}})
    validate_recipe({"sft": {"eval_every": 0}})


@pytest.mark.parametrize("preset", ["tiny", "quickstart", "small"])
def test_model_preset_with_model_path_is_refused(preset):
    """model.path loads a model and model.preset sizes one built from scratch: set together, the preset was accepted
    and ignored by every command (path won), even an explicit `preset: tiny`. preset null (the default) means tiny
    when path is null."""
    message = refusal({"model": {"preset": preset, "path": "runs/dense"}})
    assert message.startswith(f"model: preset ('{preset}') and path ('runs/dense') are both set"), message
    assert "model.path loads that model" in message and "model.preset" in message
    assert validate_recipe({"model": {"path": "runs/dense"}}).model.preset is None
    assert validate_recipe({"model": {"preset": None, "path": "runs/dense"}}).model.path == "runs/dense"
    assert validate_recipe({}).model.scratch_preset == "tiny"
    assert validate_recipe({"model": {"preset": preset}}).model.scratch_preset == preset


@pytest.mark.parametrize("key, value", [("eval_every", 10), ("eval_sequences", 4)])
def test_indexer_warmup_evaluation_keys_without_held_out_prompts_are_refused(key, value):
    """corpus tasks cuts the warm-up's evaluation windows from the tasks' held-out prompts (it drew them from the
    training split before): with none, indexer_warmup.eval_every and eval_sequences set evaluate nothing, as sft's
    eval keys there. At their defaults the warm-up runs without evaluation; corpus dataset has its own held-out
    windows."""
    message = refusal({"indexer_warmup": {key: value}})
    assert message.startswith(f"indexer_warmup.{key} ({value}) needs held-out prompts with corpus 'tasks': set "
                              "eval_size or eval_fraction on a task in data.tasks"), message
    validate_recipe({"indexer_warmup": {key: value}, "data": {"tasks": [{"kind": "arithmetic", "eval_size": 8}]}})
    validate_recipe({"indexer_warmup": {key: value, "corpus": "dataset", "dataset_path": "c.jsonl"}})
    validate_recipe({"indexer_warmup": {"eval_every": 0}})


@pytest.mark.parametrize("engine", [{"engine": "sglang"}, EXTERNAL])
def test_num_continuous_decode_steps_for_servers_is_refused(engine):
    """The embedded engines' decode steps a launch: SGLang and external servers take their own flag."""
    data = {"rollout": {**engine, "num_continuous_decode_steps": 4}, "cluster": {"num_gpus_per_engine": 1}}
    assert "rollout.num_continuous_decode_steps applies to embedded engines" in refusal(data)
    assert validate_recipe({"rollout": {"num_continuous_decode_steps": 4}}).rollout.num_continuous_decode_steps == 4
    assert "num_continuous_decode_steps" in refusal({"rollout": {"num_continuous_decode_steps": 0}})


@pytest.mark.parametrize("engine", [{"engine": "sglang"}, EXTERNAL])
def test_enable_torch_compile_for_servers_or_with_true_on_policy_is_refused(engine):
    """The embedded engines' compiled pointwise chains: servers take their own flag, and batch-invariant ops replace
    the chains the flag compiles."""
    data = {"rollout": {**engine, "enable_torch_compile": True}, "cluster": {"num_gpus_per_engine": 1}}
    assert "rollout.enable_torch_compile applies to embedded engines" in refusal(data)
    message = refusal({"rollout": {"enable_torch_compile": True}, "model": {"true_on_policy": True}})
    assert message.startswith("rollout.enable_torch_compile fuses ops that model.true_on_policy's"), message
    assert validate_recipe({"rollout": {"enable_torch_compile": True}}).rollout.enable_torch_compile
