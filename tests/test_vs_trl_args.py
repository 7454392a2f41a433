"""benchmarks/vs_trl.py's arguments: --task-args reaches our recipe (and so the prompts both sides get)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.vs_trl import parse_args, recipe_dict, setup_desc, task_desc, trl_micro_batch
from slime_dsa.config import RecipeConfig

LONG = '{"min_numbers": 3, "max_numbers": 3, "worked_steps": true, "worked_search": true}'


def test_task_args_reach_the_recipe() -> None:
    args = parse_args(["--device", "cuda", "--task", "countdown", "--task-args", LONG, "--max-new-tokens", "384"])
    recipe = RecipeConfig.model_validate(recipe_dict(args, Path("m"), Path("run")))
    task = recipe.data.tasks[0]
    assert task.kind == "countdown" and task.task_args == {"min_numbers": 3, "max_numbers": 3, "worked_steps": True,
                                                              "worked_search": True}
    assert recipe.rollout.max_response_length == 384 and '"worked_steps": true' in task_desc(args)
    arithmetic = recipe_dict(parse_args(["--task-args", '{"ops": "+"}']), Path("m"), Path("run"))
    assert arithmetic["data"]["tasks"][0]["task_args"] == {"max_digits": 2, "ops": "+"}  # over the default


@pytest.mark.parametrize("text", ["[1, 2]", "{bad"])
def test_task_args_must_be_a_json_object(text: str) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--task", "countdown", "--task-args", text])


def test_ours_kv_cache_reaches_the_recipe_on_cuda_only() -> None:
    args = parse_args(["--device", "cuda", "--task", "countdown", "--ours-kv-cache", "release"])
    recipe = RecipeConfig.model_validate(recipe_dict(args, Path("m"), Path("run")))
    assert recipe.cluster.engine_kv_cache_in_training == "release"
    assert RecipeConfig.model_validate(recipe_dict(parse_args(["--device", "cuda"]), Path("m"), Path("run"))
                                       ).cluster.engine_kv_cache_in_training == "auto"
    with pytest.raises(SystemExit):
        parse_args(["--ours-kv-cache", "keep"])  # CPU: nothing is handed over


def test_ours_overlap_reaches_the_recipe() -> None:
    on = RecipeConfig.model_validate(recipe_dict(parse_args([]), Path("m"), Path("run")))
    off = RecipeConfig.model_validate(recipe_dict(parse_args(["--ours-overlap", "off"]), Path("m"), Path("run")))
    assert on.rollout.overlap_schedule and not off.rollout.overlap_schedule
    ahead = parse_args(["--device", "cuda", "--ours-prefetch", "on"])
    assert RecipeConfig.model_validate(recipe_dict(ahead, Path("m"), Path("run"))).rollout.prefetch_next_step
    assert not on.rollout.prefetch_next_step and "calls on," in setup_desc(ahead)[1]
    with pytest.raises(SystemExit):
        parse_args(["--ours-loop", "async", "--ours-prefetch", "on"])
    cuda = RecipeConfig.model_validate(recipe_dict(parse_args(["--device", "cuda"]), Path("m"), Path("run")))
    assert cuda.rollout.prefetch_next_step  # recipes/gpu_single.yaml's
    cuda_async = parse_args(["--device", "cuda", "--ours-loop", "async"])
    assert not RecipeConfig.model_validate(recipe_dict(cuda_async, Path("m"), Path("run"))).rollout.prefetch_next_step
    assert parse_args(["--device", "cuda", "--ours-prefetch", "off"]).ours_prefetch == "off"
    compiled = parse_args(["--device", "cuda", "--ours-compile", "on"])
    assert RecipeConfig.model_validate(recipe_dict(compiled, Path("m"), Path("run"))).trainer.compile
    assert not cuda.trainer.compile and "trainer.compile on)" in setup_desc(compiled)[1]


def test_trl_trains_a_large_step_in_accumulated_micro_batches() -> None:
    assert trl_micro_batch(parse_args(["--prompts-per-step", "64", "--group-size", "16"])) == 256
    assert trl_micro_batch(parse_args(["--prompts-per-step", "4", "--group-size", "8"])) == 32
    with pytest.raises(SystemExit):
        parse_args(["--prompts-per-step", "64", "--group-size", "16", "--trl-micro-batch", "300"])


def test_trl_attention_is_sdpa_unless_asked_and_the_setup_line_says_which() -> None:
    assert parse_args([]).trl_attn == "sdpa"
    args = parse_args(["--device", "cuda", "--trl-attn", "eager"])
    assert "attn_implementation eager" in setup_desc(args)[1]
    assert "attn_implementation sdpa" in setup_desc(parse_args([]))[1]
    with pytest.raises(SystemExit):
        parse_args(["--trl-attn", "flash"])


def test_ours_loop_async_runs_async_reinforce_beside_the_trainer_on_the_gpu() -> None:
    args = parse_args(["--device", "cuda", "--task", "countdown", "--ours-loop", "async"])
    recipe = RecipeConfig.model_validate(recipe_dict(args, Path("m"), Path("run")))
    assert recipe.algorithm.name == "async_reinforce" and recipe.algorithm.max_staleness == 1
    assert recipe.cluster.placement == "disaggregated"
    assert (recipe.cluster.num_gpus_per_engine, recipe.cluster.num_gpus_per_trainer) == (0.5, 0.5)
    assert "async_reinforce in the asynchronous loop" in setup_desc(args)[1]
    sync = RecipeConfig.model_validate(recipe_dict(parse_args(["--device", "cuda"]), Path("m"), Path("run")))
    assert sync.algorithm.name == "grpo" and sync.cluster.placement == "colocated"
    assert "GRPO in the synchronous loop" in setup_desc(parse_args([]))[1]
    cpu = RecipeConfig.model_validate(recipe_dict(parse_args(["--ours-loop", "async"]), Path("m"), Path("run")))
    assert cpu.algorithm.name == "async_reinforce" and cpu.cluster.num_gpus_per_engine == 0
    two = parse_args(["--device", "cuda", "--ours-loop", "async", "--ours-max-staleness", "2"])
    assert RecipeConfig.model_validate(recipe_dict(two, Path("m"), Path("run"))).algorithm.max_staleness == 2
    assert "max_staleness 2" in setup_desc(two)[1] and "partial_rollout retract" in setup_desc(two)[1]
    kept = parse_args(["--device", "cuda", "--ours-loop", "async", "--ours-partial-rollout", "in_place"])
    assert RecipeConfig.model_validate(recipe_dict(kept, Path("m"), Path("run"))).algorithm.partial_rollout == "in_place"
    assert "partial_rollout in_place" in setup_desc(kept)[1]
    for refused in (["--ours-kv-cache", "keep"], ["--recompute-old-logprobs"], ["--ours-max-staleness", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["--device", "cuda", "--ours-loop", "async", *refused])
    with pytest.raises(SystemExit):
        parse_args(["--ours-max-staleness", "2"])  # the synchronous loop has none
    with pytest.raises(SystemExit):
        parse_args(["--ours-partial-rollout", "in_place"])  # nor partial rollouts
