"""Recipes: schema defaults and descriptions, `defaults:` inheritance with origins, `--set` overrides, and
one-line errors that name the key and where it was set."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from slime_dsa.config import (
    RecipeConfig,
    RecipeError,
    defaults_yaml,
    dump_recipe,
    explain,
    load_recipe,
    validate_recipe,
)
from slime_dsa.config.introspect import as_model, list_item, schema_paths, sections

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def recipe_error(*args, **kwargs) -> str:
    """The message of the RecipeError that load_recipe raises; it must be one line."""
    with pytest.raises(RecipeError) as info:
        load_recipe(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------------------------ schema


def test_empty_recipe_is_valid(tmp_path):
    empty = write(tmp_path, "empty.yaml", "")
    assert load_recipe(empty) == load_recipe(None) == RecipeConfig()
    config = RecipeConfig()
    assert config.model.path is None and config.rollout.engine == "embedded"
    assert config.cluster.num_gpus_per_engine == 0 and config.cluster.num_gpus_per_trainer == 0
    assert config.rollout.max_concurrency is None and config.rollout.n_samples_per_prompt == 8
    assert (config.algorithm.eps_clip_low, config.algorithm.eps_clip_high) == (0.2, 0.28)
    assert [t.name for t in config.data.tasks] == ["arithmetic"]


def test_model_index_topk_is_a_recipe_key(tmp_path):
    assert load_recipe(None, ["model.index_topk=512"]).model.index_topk == 512
    assert "index_topk" in recipe_error(None, ["model.index_topk=0"])


def _models(model: type[BaseModel]):
    yield model
    for field in model.model_fields.values():
        sub = as_model(field.annotation) or as_model(list_item(field.annotation))
        if sub is not None:
            yield from _models(sub)


def test_every_field_has_a_description_and_sections_forbid_extra_keys():
    for model in _models(RecipeConfig):
        assert model.__doc__ and model.__doc__.strip(), f"{model.__name__} has no docstring"
        assert model.model_config.get("extra") == "forbid", model.__name__
        for name, field in model.model_fields.items():
            assert field.description and len(field.description.strip()) > 10, f"{model.__name__}.{name}"


def test_sections_and_key_names():
    assert list(RecipeConfig.model_fields) == [
        "model", "data", "rollout", "algorithm", "trainer", "critic", "teachers", "cluster", "logging", "checkpoint",
        "sft", "indexer_warmup"]
    keys = {".".join(p) for p in schema_paths()}
    for key in ("model.ops_backend", "data.tasks.<i>.reward_fn", "rollout.sglang.weight_sync",
                "rollout.return_indexer_topk", "algorithm.icepop_beta", "algorithm.dis_eps_high",
                "trainer.logprob_diff_warn_threshold", "cluster.placement", "logging.wandb_mode",
                "checkpoint.keep_last", "algorithm.critic_updates_per_step", "critic.learning_rate"):
        assert key in keys


def test_values_are_not_coerced_between_types():
    with pytest.raises(RecipeError, match=r"trainer\.num_steps: expected an integer, got 1\.5"):
        validate_recipe({"trainer": {"num_steps": 1.5}})
    with pytest.raises(RecipeError, match=r"trainer\.mixed_precision: expected true or false, got 'yes'"):
        validate_recipe({"trainer": {"mixed_precision": "yes"}})
    assert validate_recipe({"rollout": {"temperature": 1}}).rollout.temperature == 1.0  # int is a fine float


def test_exponent_floats_parse_as_numbers(tmp_path):
    # plain YAML 1.1 reads 1e-6 as a string
    path = write(tmp_path, "r.yaml", "trainer:\n  learning_rate: 1e-6\n")
    assert load_recipe(path).trainer.learning_rate == 1e-6
    assert load_recipe(None, ["trainer.learning_rate=3e-7"]).trainer.learning_rate == 3e-7


def test_a_bare_off_or_on_is_the_word_not_a_boolean(tmp_path):
    # YAML 1.1 reads a bare off/on as false/true; partial_rollout and pin_cpus name those values as words
    path = write(tmp_path, "r.yaml", "algorithm:\n  name: async_reinforce\n  partial_rollout: off\n"
                                     "cluster:\n  pin_cpus: on\n")
    recipe = load_recipe(path)
    assert (recipe.algorithm.partial_rollout, recipe.cluster.pin_cpus) == ("off", "on")
    over = load_recipe(path, ["algorithm.partial_rollout=off", "cluster.pin_cpus=off"])
    assert (over.algorithm.partial_rollout, over.cluster.pin_cpus) == ("off", "off")
    assert "got true" in recipe_error(path, ["algorithm.partial_rollout=true"])  # still no other boolean


def test_null_section_means_empty(tmp_path):
    path = write(tmp_path, "r.yaml", "rollout:\n  # temperature: 0.7\nalgorithm:\n")
    assert load_recipe(path) == RecipeConfig()


@pytest.mark.parametrize(("data", "pattern"), [
    ({"algorithm": {"eps_clip_low": 1.5}}, r"algorithm\.eps_clip_low: must be in \[0, 1\), got 1\.5"),
    ({"algorithm": {"name": "async_reinforce", "dis_eps_low": 0}},  # a ValueError traceback once Ray had started
     r"algorithm\.dis_eps_low: must be in \(0, 1\], got 0"),
    ({"rollout": {"engine": "vllm"}}, r"rollout\.engine: expected one of 'embedded', 'sglang' or 'external', got"),
    ({"rollout": {"top_k": 0}}, r"rollout: top_k \(0\) must be -1"),
    ({"rollout": {"engine": "external"}}, r"engine 'external' needs engine_urls"),
    # were accepted, and the run lost its only engine at step 1, after Ray and the trainers had started
    ({"rollout": {"engine": "external", "engine_urls": ["http://127.0.0.1:30000", "ftp://h:1"]}},
     r"rollout: engine_urls\[1\] 'ftp://h:1' is not an http:// or https:// URL"),
    ({"rollout": {"engine": "external", "engine_urls": ["h:port"]}}, r"engine_urls\[0\] 'h:port' has no valid port"),
    ({"rollout": {"engine": "external", "engine_urls": ["http://:30000"]}},
     r"engine_urls\[0\] 'http://:30000' names no host"),
    ({"data": {"tasks": [{"kind": "dataset"}]}}, r"data\.tasks\.0: kind 'dataset' needs a path"),
    ({"data": {"tasks": [{"reward_fn": "not an import path"}]}}, r"must be a registered name or look like 'package\.module:function'"),
    ({"data": {"tasks": [{}, {}]}}, r"task names must be unique, but 'arithmetic' appears 2 times"),
    ({"data": {"tasks": [{"kind": "countdown", "task_args": {"num_count": 4}}]}},
     r"data\.tasks\.0: countdown: unknown task parameter 'num_count'; expected some of \['min_numbers'"),
    ({"data": {"tasks": [{"kind": "countdown", "task_args": {"worked_steps": "yes"}}]}},
     r"data\.tasks\.0: countdown: task parameter worked_steps \('yes'\) must be of type bool"),
    ({"data": {"tasks": [{"kind": "countdown", "task_args": {"max_numbers": 9}}]}},
     r"countdown: need 2 <= min_numbers \(3\) <= max_numbers \(9\) <= 8"),
    ({"data": {"tasks": [{"kind": "arithmetic", "task_args": {"max_digits": 2.5}}]}},
     r"arithmetic: task parameter max_digits \(2\.5\) must be of type int"),
    ({"data": {"tasks": []}}, r"data\.tasks: list should have at least 1 item"),
    ({"algorithm": {"icepop_alpha": 1.0, "icepop_beta": 1.0}}, r"icepop_alpha \(1\.0\) must be below icepop_beta"),
    ({"algorithm": {"freeze_indexer": True, "indexer_loss_coef": 1.0}}, r"freeze_indexer is true"),
    ({"algorithm": {"indexer_learning_rate": 1e-2}},  # accepted and ignored before
     r"algorithm: indexer_learning_rate \(0\.01\) applies to the indexer loss, which indexer_loss_coef 0 turns off"),
    ({"algorithm": {"indexer_loss_stage": "dense"}}, r"algorithm: indexer_loss_stage \('dense'\) applies to the"),
    ({"algorithm": {"indexer_loss_target": "own"}}, r"indexer_loss_target \('own'\) applies to the indexer loss"),
    ({"algorithm": {"name": "async_reinforce", "max_staleness": 0, "partial_rollout": "in_place"}},  # did nothing
     r"algorithm: partial_rollout \('in_place'\) says what happens to responses in flight at a weight push, which "
     r"max_staleness 0 never has"),
    ({"algorithm": {"name": "async_reinforce"}, "trainer": {"logprob_diff_warn_threshold": 0.01}},  # never warned
     r"trainer\.logprob_diff_warn_threshold is not read with algorithm 'async_reinforce': without π_old"),
    ({"algorithm": {"name": "async_reinforce", "is_correction": "icepop"}},
     r"is_correction is not read by algorithm 'async_reinforce' \(it applies to grpo, opd\)"),
    ({"algorithm": {"name": "sao"}, "critic": {"num_workers": 2}}, r"critic\.num_workers \(2\) applies to placement"),
    ({"critic": {"path": "v"}}, r"critic\.path is read only by algorithms with a value model \(sao\)"),
    ({"algorithm": {"name": "opd"}}, r"algorithm 'opd' needs at least one entry in teachers"),
    ({"algorithm": {"name": "ppo"}}, r"unknown algorithm 'ppo'; choose one of grpo, async_reinforce, sao"),
    ({"algorithm": {"kl_coef": 0.1}}, r"kl_coef \(0\.1\) is not available yet"),
    ({"algorithm": {"max_staleness": 4}}, r"max_staleness is not read by algorithm 'grpo'"),
    ({"algorithm": {"is_correction": "tis", "use_rollout_logprobs": True}}, r"which are the same with"),
    ({"trainer": {"megatron": {"tensor_parallel": 2}}}, r"trainer\.megatron is read only by backend 'megatron'"),
    ({"trainer": {"backend": "megatron", "megatron": {"pipeline_parallel": 2}}},
     r"trainer\.megatron\.pipeline_parallel \(2\) > 1 is not built yet"),
    ({"trainer": {"backend": "megatron", "num_workers": 3, "megatron": {"tensor_parallel": 2}}},
     r"num_workers \(3\) must be a multiple of megatron\.tensor_parallel \(2\)"),
    ({"trainer": {"backend": "megatron", "data_parallel": "replicate"}},
     r"trainer: data_parallel 'replicate' applies to backend 'fsdp'; Megatron splits"),
    ({"trainer": {"backend": "megatron"}, "cluster": {"num_gpus_per_engine": 1},
      "rollout": {"engine": "sglang", "sglang": {"weight_sync": "distributed"}}},
     r"rollout\.sglang\.weight_sync 'distributed' \(auto's choice when disaggregated\) is not built"),
    ({"trainer": {"backend": "megatron"}, "rollout": {"weight_sync": "cuda_ipc"}},
     r"rollout\.weight_sync 'cuda_ipc' is not built for trainer\.backend 'megatron'"),
    ({"rollout": {"engine": "sglang", "prefetch_next_step": True}, "cluster": {"num_gpus_per_engine": 1}},
     r"rollout\.prefetch_next_step is built for embedded engines, not rollout\.engine 'sglang'"),
    ({"rollout": {"prefetch_next_step": True}, "algorithm": {"name": "async_reinforce"}},
     r"rollout\.prefetch_next_step applies to the synchronous loop; algorithm 'async_reinforce' runs the asynchronous"),
    ({"trainer": {"backend": "megatron"}, "cluster": {"num_gpus_per_trainer": 1},
      "algorithm": {"indexer_learning_rate": 1e-4, "indexer_loss_coef": 0.1}},
     r"algorithm\.indexer_learning_rate is not built for megatron's DistributedOptimizer \(trainer ranks on GPUs\)"),
    ({"trainer": {"deepspeed": {"zero_stage": 2}}}, r"trainer: deepspeed\.zero_stage applies to backend 'deepspeed', but backend is 'fsdp'"),
    ({"trainer": {"backend": "deepspeed", "data_parallel": "replicate"}},
     r"trainer: data_parallel 'replicate' applies to backend 'fsdp'"),
    ({"trainer": {"backend": "deepspeed", "deepspeed": {"zero_stage": 2, "offload_param": "cpu"}}},
     r"trainer\.deepspeed: offload_param 'cpu' needs zero_stage 3"),
    ({"trainer": {"backend": "deepspeed", "deepspeed": {"cpu_adam": True}}},
     r"trainer\.deepspeed: cpu_adam runs the optimizer step on the host: it needs offload_optimizer 'cpu'"),
    ({"trainer": {"backend": "deepspeed", "deepspeed": {"zero_stage": 1, "param_persistence_threshold": 0}}},
     r"trainer\.deepspeed: param_persistence_threshold applies to zero_stage 3"),
    ({"trainer": {"backend": "deepspeed", "deepspeed": {"offload_optimizer": "nvme"}}},
     r"trainer\.deepspeed\.offload_optimizer: expected one of 'none' or 'cpu'"),
    ({"rollout": {"n_samples_per_prompt": 1}}, r"rollout\.n_samples_per_prompt \(1\) must be at least 2"),
    ({"algorithm": {"index_replay": True}}, r"needs rollout\.return_indexer_topk"),
    ({"rollout": {"max_response_length": 8192}}, r"trainer\.micro_batch_tokens \(4096\) must hold"),
    ({"rollout": {"engine": "sglang"}}, r"needs GPUs: set cluster\.num_gpus_per_engine"),
    # the run paused servers it did not start for every train call and released their KV cache
    ({"rollout": {"engine": "external", "engine_urls": ["http://127.0.0.1:30000"]},
      "cluster": {"num_gpus_per_engine": 1}},
     r"cluster\.num_gpus_per_engine \(1\) with placement 'colocated' makes the engines take turns with the "
     r"trainers .*rollout\.engine 'external' servers are not the run's to pause"),
    ({"rollout": {"sglang": {"weight_sync": "tensor"}}}, r"rollout\.sglang\.weight_sync 'tensor' is not available yet"),
    ({"data": {"tasks": [{"kind": "arithmetic", "split": "test"}]}},  # accepted and ignored by built-in tasks before
     r"data\.tasks\.0: split \('test'\) is only read by kind 'dataset', but kind is 'arithmetic'"),
    ({"rollout": {"sglang": {"tp": 2}}},  # accepted and ignored by the embedded engines before
     r"rollout\.sglang\.tp is read only by SGLang servers .*, but rollout\.engine is 'embedded'"),
    ({"rollout": {"engine": "sglang", "weight_sync": "shm"}, "cluster": {"num_gpus_per_engine": 1}},
     r"rollout\.weight_sync 'shm' is for embedded and external engines; SGLang servers take rollout\.sglang\.weight_sync"),
    ({"logging": {"eval_every": 5}}, r"logging\.eval_every \(5\) needs held-out prompts"),
    ({"checkpoint": {"resume": True}}, r"checkpoint\.resume needs a fixed place"),
    ({"trainer": {"warmup_steps": 500}}, r"warmup_steps \(500\) exceeds the run's 100 optimizer steps"),
    ({"trainer": {"adam_betas": [0.9, 1.5]}}, r"trainer\.adam_betas: both betas must be in \[0, 1\)"),
    ({"rollout": {"dynamic_sampling": True, "oversample_factor": 2.0, "max_oversample_factor": 1.5}},
     r"max_oversample_factor \(1\.5\) must be at least oversample_factor \(2\.0\)"),
    ({"trainer": {"data_parallel": "replicate", "mixed_precision": True}, "cluster": {"num_gpus_per_trainer": 1}},
     r"data_parallel 'replicate' trains in float32"),
    ({"trainer": {"backend": "deepspeed", "mixed_precision": True}},
     r"trainer\.mixed_precision with trainer\.backend 'deepspeed' needs GPU trainers"),
])
def test_validators_name_the_values(data, pattern):
    with pytest.raises(RecipeError, match=pattern):
        validate_recipe(data)


def test_valid_combinations_pass():
    config = validate_recipe({
        "rollout": {"engine": "external", "engine_urls": ["http://127.0.0.1:30000"], "dynamic_sampling": True,
                    "return_indexer_topk": True},  # oversample_factor: the synchronous loop's (refused here)
        "algorithm": {"name": "async_reinforce", "index_replay": True, "dis_eps_high": 3.0, "max_staleness": 1},
        "data": {"tasks": [{"kind": "dataset", "path": "openai/gsm8k", "eval_size": 64, "weight": 2},
                           {"kind": "countdown", "reward_fn": "my_pkg.rewards:score"}]},
        "logging": {"eval_every": 10},
        "trainer": {"adam_betas": [0.9, 0.95]},
    })
    assert [t.name for t in config.data.tasks] == ["dataset", "countdown"]
    assert config.trainer.adam_betas == (0.9, 0.95)


# ----------------------------------------------------------------------------------------------- errors


def test_misspelled_key_names_key_file_line_and_suggestion(tmp_path):
    path = write(tmp_path, "r.yaml", """\
        rollout:
          temprature: 0.7
        """)
    message = recipe_error(path)
    assert message == f"{_shown(path)}:2: rollout.temprature: unknown key, did you mean rollout.temperature?"


def test_key_in_the_wrong_section_suggests_the_right_one():
    with pytest.raises(RecipeError, match=r"algorithm\.temperature: unknown key, did you mean rollout\.temperature\?"):
        validate_recipe({"algorithm": {"temperature": 0.7}})
    with pytest.raises(RecipeError, match=r"rollouts: unknown key, did you mean rollout\?"):
        validate_recipe({"rollouts": {}})
    with pytest.raises(RecipeError, match=r"data\.tasks\.0\.nme: unknown key, did you mean data\.tasks\.0\.name\?"):
        validate_recipe({"data": {"tasks": [{"nme": "x"}]}})


@pytest.mark.parametrize("override, suggestion", [
    ("trainer.lr=abc", "trainer.learning_rate"),  # an abbreviation: the initials of the words
    ("trainer.wd=0.1", "trainer.weight_decay"),
    ("algorithm.clip_eps_hihg=0.3", "algorithm.eps_clip_high"),  # words swapped, one misspelled
    ("algorithm.eps_clip_hi=0.3", "algorithm.eps_clip_high"),
    ("rollout.max_len=64", "rollout.max_response_length"),
    ("rollout.temprature=1", "rollout.temperature"),
    ("trainer.warmup=3", "trainer.warmup_steps"),
])
def test_suggestions_match_words_and_abbreviations(override, suggestion):
    with pytest.raises(RecipeError) as info:
        load_recipe(None, [override])
    assert str(info.value).endswith(f"unknown key, did you mean {suggestion}?")


def test_wrong_type_says_what_was_expected(tmp_path):
    path = write(tmp_path, "r.yaml", "rollout:\n  temperature: hot\n")
    assert recipe_error(path) == f"{_shown(path)}:2: rollout.temperature: expected a number, got 'hot'"
    path = write(tmp_path, "s.yaml", "rollout: 5\n")
    assert "rollout: expected a mapping of keys (a section), got 5" in recipe_error(path)


def test_several_problems_are_listed_on_one_line(tmp_path):
    path = write(tmp_path, "r.yaml", "rollout:\n  temperature: hot\n  top_p: 2\ntrainer:\n  num_steps: x\n")
    assert recipe_error(path).endswith("(and 2 more: rollout.top_p, trainer.num_steps)")


def test_missing_recipe_file(tmp_path):
    assert recipe_error(tmp_path / "nope.yaml") == f"recipe file {_shown(tmp_path / 'nope.yaml')} not found"


def test_missing_defaults_file_names_the_referencing_file(tmp_path):
    path = write(tmp_path, "r.yaml", "# header\ndefaults: ../missing/base.yaml\n")
    message = recipe_error(path)
    assert message.startswith(f"{_shown(path)}:2: defaults: recipe file ")
    assert message.endswith("missing/base.yaml not found")


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, "r.yaml", "rollout:\n  temperature: 0.7\n top_p: [1\n")
    assert recipe_error(path).startswith(f"{_shown(path)}:3: malformed YAML: ")


@pytest.mark.parametrize(("text", "what"), [("- a\n- b\n", "got a list"), ("42\n", "got a single value (42)")])
def test_top_level_must_be_a_mapping(tmp_path, text, what):
    path = write(tmp_path, "r.yaml", text)
    assert recipe_error(path) == f"{_shown(path)}: a recipe must be a mapping of sections (model:, data:, " \
                                 f"rollout:, ...), {what}"


def test_duplicate_and_non_string_keys(tmp_path):
    path = write(tmp_path, "r.yaml", "rollout:\n  top_p: 0.9\n  top_p: 0.8\n")
    assert recipe_error(path) == f"{_shown(path)}:3: rollout.top_p: duplicate key (first set on line 2)"
    path = write(tmp_path, "s.yaml", "rollout:\n  1: 0.9\n")
    assert recipe_error(path) == f"{_shown(path)}:2: rollout: keys must be strings, got 1"


# -------------------------------------------------------------------------------- inheritance and origins


def test_defaults_inherit_recursively_child_wins_lists_replace(tmp_path):
    write(tmp_path, "shared/root.yaml", """\
        rollout: {temperature: 0.5, top_p: 0.9, stop: ["</a>", "</b>"]}
        trainer: {num_steps: 7}
        """)
    write(tmp_path, "shared/base.yaml", """\
        defaults: root.yaml
        rollout: {top_p: 0.8}
        data:
          tasks: [{kind: countdown}, {kind: arithmetic}]
        """)
    write(tmp_path, "shared/other.yaml", "trainer: {num_steps: 9, learning_rate: 2.0e-6}\n")
    child = write(tmp_path, "recipes/child.yaml", """\
        defaults: [../shared/base.yaml, ../shared/other.yaml]
        rollout:
          stop: ["</c>"]
        data:
          tasks: [{kind: countdown, weight: 3}]
        """)
    config = load_recipe(child)
    assert config.rollout.temperature == 0.5  # from root, two levels up
    assert config.rollout.top_p == 0.8  # base over root
    assert config.rollout.stop == ["</c>"]  # lists replace, never concatenate
    assert [(t.kind, t.weight) for t in config.data.tasks] == [("countdown", 3.0)]
    assert config.trainer.num_steps == 9 and config.trainer.learning_rate == 2e-6  # later defaults win
    assert config.rollout.n_samples_per_prompt == 8  # untouched keys keep the schema default


def test_errors_name_the_file_the_key_came_from(tmp_path):
    base = write(tmp_path, "base.yaml", "rollout:\n  temperature: 0.5\n  top_p: 7\n")
    child = write(tmp_path, "child.yaml", "defaults: base.yaml\nrollout:\n  temperature: 0.7\n")
    assert recipe_error(child) == f"{_shown(base)}:3: rollout.top_p: must be in (0, 1], got 7"
    # a key the child replaces is blamed on the child
    write(tmp_path, "base2.yaml", "rollout:\n  temperature: 0.5\n")
    child2 = write(tmp_path, "child2.yaml", "defaults: base2.yaml\nrollout:\n  temperature: -1\n")
    assert recipe_error(child2) == f"{_shown(child2)}:3: rollout.temperature: must be >= 0, got -1"


def test_cross_field_errors_name_where_each_key_was_set(tmp_path):
    write(tmp_path, "base.yaml", "algorithm:\n  name: grpo\n")
    child = write(tmp_path, "child.yaml", "defaults: base.yaml\nrollout:\n  n_samples_per_prompt: 1\n")
    message = recipe_error(child)
    assert message.startswith(f"{_shown(child)}:3, {_shown(tmp_path / 'base.yaml')}:2: rollout.n_samples_per_prompt")


def test_defaults_cycle_is_an_error(tmp_path):
    write(tmp_path, "a.yaml", "defaults: b.yaml\n")
    write(tmp_path, "b.yaml", "defaults: a.yaml\n")
    assert "defaults form a cycle" in recipe_error(tmp_path / "a.yaml")


def test_defaults_must_be_paths(tmp_path):
    path = write(tmp_path, "r.yaml", "defaults: {a: 1}\n")
    assert recipe_error(path) == f"{_shown(path)}:1: defaults: expected a file path or a list of file paths, " \
                                 "got {'a': 1}"


# ------------------------------------------------------------------------------------------------- --set


def test_set_overrides_scalars_lists_and_sections(tmp_path):
    path = write(tmp_path, "r.yaml", "rollout:\n  temperature: 0.5\n")
    config = load_recipe(path, [
        "rollout.temperature=0.7",
        "rollout.stop=['</answer>']",
        "rollout.sglang.tp=2",
        "rollout.engine=sglang",  # rollout.sglang is read only by SGLang servers
        "cluster.num_gpus_per_engine=1",
        "model.path=null",
        "data.tasks=[{kind: countdown}, {kind: arithmetic, weight: 2}]",
        "data.tasks.0.weight=3",
        "data.tasks.2.kind=dataset",  # index == length appends
        "data.tasks.2.path=my/ds",
        "algorithm=null",
        "algorithm.name=async_reinforce",
    ])
    assert config.rollout.temperature == 0.7 and config.rollout.stop == ["</answer>"]
    assert config.rollout.sglang.tp == 2
    assert [(t.kind, t.weight) for t in config.data.tasks] == [("countdown", 3.0), ("arithmetic", 2.0),
                                                               ("dataset", 1.0)]
    assert config.algorithm.name == "async_reinforce"


def test_set_indexes_into_the_default_task_list():
    config = load_recipe(None, ["data.tasks.0.weight=2", "data.tasks.1.kind=countdown"])
    assert [(t.name, t.weight) for t in config.data.tasks] == [("arithmetic", 2.0), ("countdown", 1.0)]


def test_set_later_wins_and_overrides_files(tmp_path):
    path = write(tmp_path, "r.yaml", "rollout:\n  temperature: 0.5\n")
    assert load_recipe(path, ["rollout.temperature=0.6", "rollout.temperature=0.9"]).rollout.temperature == 0.9


@pytest.mark.parametrize(("item", "expected"), [
    ("rollout.temperature=hot",
     "command line (--set rollout.temperature=hot): rollout.temperature: expected a number, got 'hot'"),
    ("rollout.temprature=0.7",
     "command line (--set rollout.temprature=0.7): rollout.temprature: unknown key, did you mean "
     "rollout.temperature?"),
    ("data.tasks.0.weight=-1",
     "command line (--set data.tasks.0.weight=-1): data.tasks.0.weight: must be >= 0, got -1"),
    ("rollout.temperature", "command line (--set rollout.temperature): expected KEY=VALUE, e.g. --set "
                            "rollout.temperature=0.7"),
    ("rollout..x=1", "command line (--set rollout..x=1): 'rollout..x' has an empty part; keys look like "
                     "rollout.sglang.tp"),
    ("rollout.stop=[a", "command line (--set rollout.stop=[a): rollout.stop: the value is not valid YAML"),
    ("data.tasks.5.weight=1", "command line (--set data.tasks.5.weight=1): data.tasks is a list of 1 item(s) and '5' "
                              "is past its end; index it with 0 to 1"),
    ("data.tasks.x.weight=2", "command line (--set data.tasks.x.weight=2): data.tasks is a list of 1 item(s) and 'x' "
                              "is not an index; index it with 0 to 1"),
    ("data.tasks.0.task_args.worked_steps=1", "command line (--set data.tasks.0.task_args.worked_steps=1): "
                                              "data.tasks.0: arithmetic: unknown task parameter 'worked_steps'"),
    ("defaults=x.yaml", "command line (--set defaults=x.yaml): defaults can only be given in a recipe file"),
    ("trainer.adam_betas=[0.9]",  # it said "required key is missing"
     "command line (--set trainer.adam_betas=[0.9]): trainer.adam_betas: too few items: item 1 is missing"),
])
def test_set_errors_say_they_came_from_the_command_line(item, expected):
    assert recipe_error(None, [item]).startswith(expected)


def test_set_into_a_scalar_is_an_error(tmp_path):
    path = write(tmp_path, "r.yaml", "rollout:\n  temperature: 0.5\n")
    assert recipe_error(path, ["rollout.temperature.x=1"]) == (
        "command line (--set rollout.temperature.x=1): rollout.temperature is 0.5, not a section with a key 'x'")


# -------------------------------------------------------------------------------- explain, dump, recipes


def test_explain_lists_every_section_and_key():
    text = explain()
    for name in sections():
        assert f"\n{name}: " in text, name
    for path in schema_paths():
        if len(path) > 1:  # top-level sections are the headers checked above
            assert f"  {'.'.join(path)}: " in text, path
    assert "  defaults: " in text
    assert "rollout.temperature: float = 1.0  (>= 0)" in text


def test_explain_one_section():
    text = explain("rollout.sglang")
    assert text.startswith("rollout.sglang: ") and "rollout.sglang.weight_sync" in text
    assert "rollout.temperature" not in text
    assert "data.tasks.<i>.weight" in explain("data.tasks")
    with pytest.raises(RecipeError, match=r"unknown section 'rolout'; did you mean rollout\?"):
        explain("rolout")


def test_dump_round_trips(tmp_path):
    config = load_recipe(None, ["rollout.temperature=0.3", "data.tasks.1.kind=countdown", "trainer.learning_rate=3e-7"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_recipe(config))
    assert load_recipe(path) == config


def test_base_recipe_spells_out_every_default():
    base = RECIPES / "base.yaml"
    assert base.read_text() == defaults_yaml(), \
        "recipes/base.yaml is out of date: slime-dsa recipe explain --yaml > recipes/base.yaml"
    assert load_recipe(base) == RecipeConfig()
    assert yaml.safe_load(defaults_yaml()) == RecipeConfig().model_dump(mode="json")


@pytest.mark.parametrize("path", sorted(RECIPES.rglob("*.yaml")), ids=lambda p: str(p.relative_to(RECIPES)))
def test_every_shipped_recipe_is_valid(path):
    load_recipe(path)


def _shown(path: Path) -> str:
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else str(path)


def test_null_max_concurrency_covers_what_the_loop_has_in_flight():
    from rollout.engine.defaults import DEFAULT_MAX_RUNNING_REQUESTS
    from slime_dsa.config.schema import ENGINE_RUNNING_REQUESTS

    assert ENGINE_RUNNING_REQUESTS == DEFAULT_MAX_RUNNING_REQUESTS

    def recipe(**rollout) -> RecipeConfig:
        return RecipeConfig.model_validate({"rollout": {"prompts_per_step": 64, "n_samples_per_prompt": 16, **rollout}})

    assert recipe().max_concurrency() == 1024 == recipe().in_flight_samples()  # synchronous: one step
    assert recipe().max_concurrency(use_async=True) == 3 * 1024  # the staleness window: max_staleness (2) + 1 steps
    dynamic = recipe(dynamic_sampling=True, oversample_factor=1.5, max_oversample_factor=2.0)
    assert dynamic.max_concurrency() == 2 * 1024  # the largest sampling round
    small = RecipeConfig.model_validate({"rollout": {"num_engines": 3}})
    assert small.in_flight_samples() == 32 and small.max_concurrency() == 3 * 256  # what the engines run at once
    assert recipe(max_concurrency=1000).max_concurrency() == 1000  # a set value is kept
    assert "24 wait for a free place" in recipe(max_concurrency=1000).concurrency_line()
    assert recipe(max_concurrency=2000).concurrency_line().startswith("rollout.max_concurrency: 2000 samples in flight")


def test_explain_sao_documents_every_key_with_default_and_source():
    from slime_dsa.algorithms.specs import ALGORITHMS, COMMON_OPTIONS  # noqa: PLC0415
    from slime_dsa.config.explain import explain_algorithm  # noqa: PLC0415
    from slime_dsa.config.schema import CriticSection  # noqa: PLC0415

    text = explain_algorithm("sao")
    keys = [f"algorithm.{k}" for k in ALGORITHMS["sao"].options if k not in COMMON_OPTIONS]
    keys += [f"critic.{k}" for k in CriticSection.model_fields]
    assert "algorithm.critic_updates_per_step" in keys and "critic.learning_rate" in keys
    for key in keys:
        entry = text.split(f"  {key}: ", 1)[1].split("\n  ", 1)[0] if f"  {key}: " in text else ""
        assert " = " in entry, f"{key} is not listed with its default"
        body = text.split(f"  {key}: ", 1)[1].split("\n  algorithm.", 1)[0].split("\n  critic.", 1)[0]
        assert "Default" in body, f"{key}: no source of its default"
