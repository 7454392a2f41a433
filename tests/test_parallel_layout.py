"""Parallel sizes against the model shape (recipe check), and IndexShare-aware pipeline stages. No megatron-core."""

from __future__ import annotations

import pytest
import yaml

from slime_dsa.models.config import ModelConfig
from slime_dsa.models.parallel_layout import ParallelSizes, check_parallel_sizes, pipeline_stages
from tests.hf_reference import TINY


def test_pipeline_stages_begin_on_full_layers():
    types = ["full", "shared", "shared", "full", "shared", "full", "shared", "shared"]
    assert pipeline_stages(types, 2) == [range(0, 3), range(3, 8)]
    stages = pipeline_stages(types, 3)
    assert [s.start for s in stages] == [0, 3, 5] and stages[-1].stop == 8
    assert all(types[s.start] == "full" for s in stages)
    assert pipeline_stages(["full"] * 8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(ValueError, match=r"pipeline_parallel \(4\) exceeds the 3 layers that compute their own"):
        pipeline_stages(types, 4)


@pytest.mark.parametrize(("sizes", "world", "message"), [
    (ParallelSizes(tensor_parallel=3), 3, r"tensor_parallel \(3\) must divide the model's num_attention_heads \(4\)"),
    (ParallelSizes(tensor_parallel=2), 2, r"tensor_parallel \(2\) must divide the model's vocab_size \(97\)"),
    (ParallelSizes(expert_parallel=3), 3, r"expert_parallel \(3\) must divide the model's n_routed_experts \(8\)"),
    (ParallelSizes(tensor_parallel=2), 3, r"trainer\.num_workers \(3\) must be a multiple of"),
])
def test_sizes_that_do_not_divide_the_model_are_refused(sizes, world, message):
    config = ModelConfig.from_dict({k: v for k, v in TINY.items() if k != "num_key_value_heads"})
    with pytest.raises(ValueError, match=message):
        check_parallel_sizes(config, sizes, world)


def test_recipe_check_names_the_megatron_key(tmp_path, capsys, monkeypatch):
    from slime_dsa.cli import main

    monkeypatch.setattr("slime_dsa.config.paths._installed", lambda module: True)  # with or without megatron-core

    model = tmp_path / "model"
    model.mkdir()
    ModelConfig.from_dict({k: v for k, v in TINY.items() if k != "num_key_value_heads"}).save(model)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"path": str(model)},
                                      "trainer": {"backend": "megatron", "num_workers": 2,
                                                  "megatron": {"tensor_parallel": 2}}}))
    assert main(["recipe", "check", str(recipe)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "slime-dsa: error: trainer.megatron.tensor_parallel (2) must divide the model's vocab_size (97)"]


@pytest.mark.parametrize(("key", "message"), [
    ("pipeline_parallel", "trainer.megatron.pipeline_parallel (2) > 1 is not built yet"),
    ("context_parallel", "trainer.megatron.context_parallel (2) > 1 is not built yet"),
])
def test_recipe_refuses_pipeline_and_context_parallelism(tmp_path, capsys, key, message):
    from slime_dsa.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"trainer": {"backend": "megatron", "num_workers": 2, "megatron": {key: 2}}}))
    assert main(["recipe", "check", str(recipe)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
