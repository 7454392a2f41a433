"""The run directory that train, sft and indexer-warmup share: recipe.yaml, a log file for the block's length."""

from __future__ import annotations

import logging

import yaml

from slime_dsa.config import load_recipe
from slime_dsa.run_dir import open_run_dir, resolve_run_dir


def test_open_run_dir_writes_the_recipe_and_logs_only_inside_the_block(tmp_path):
    recipe = load_recipe(None, [f"logging.run_dir={tmp_path / 'run'}", "rollout.temperature=0.5"])
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    root.setLevel(logging.WARNING)
    try:
        with open_run_dir(recipe, "job.log") as run_dir:
            assert run_dir == tmp_path / "run"
            logging.getLogger("slime_dsa.some.module").info("inside")
        logging.getLogger("slime_dsa.some.module").warning("after")
        assert root.handlers == handlers and root.level == logging.WARNING
    finally:
        root.setLevel(level)
    assert yaml.safe_load((run_dir / "recipe.yaml").read_text())["rollout"]["temperature"] == 0.5
    text = (run_dir / "job.log").read_text()
    assert "INFO slime_dsa.some.module: inside" in text and "after" not in text


def test_run_dir_defaults_to_runs_and_the_run_name():
    assert str(resolve_run_dir(load_recipe(None, ["logging.run_name=exp1"]))) == "runs/exp1"
    assert str(resolve_run_dir(load_recipe(None, []))).startswith("runs/run-")


def test_from_scratch_model_takes_the_recipe_index_topk(tmp_path):
    import json  # noqa: PLC0415

    from slime_dsa.run_dir import prepare_model_dir  # noqa: PLC0415

    recipe = load_recipe(None, ["model.preset=tiny", "model.index_topk=512"])
    config = json.loads((prepare_model_dir(recipe, tmp_path) / "config.json").read_text())
    assert config["index_topk"] == 512


def test_model_path_with_index_topk_is_copied_with_the_new_budget(tmp_path):
    import json  # noqa: PLC0415

    from slime_dsa.run_dir import prepare_model_dir  # noqa: PLC0415

    source = prepare_model_dir(load_recipe(None, ["model.preset=tiny"]), tmp_path / "scratch")
    recipe = load_recipe(None, [f"model.path={source}", "model.index_topk=512"])
    copied = prepare_model_dir(recipe, tmp_path / "run")
    assert copied == tmp_path / "run" / "initial_model"
    assert json.loads((copied / "config.json").read_text())["index_topk"] == 512
    assert json.loads((source / "config.json").read_text())["index_topk"] != 512
    assert (copied / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    assert prepare_model_dir(load_recipe(None, [f"model.path={source}"]), tmp_path / "plain") == source


def test_a_start_removes_the_initial_model_copies_a_killed_start_left(tmp_path):
    """A start killed while copying model.path into initial_model (or writing a from-scratch one) left its
    model-sized temporary directory in the run directory for good; the next start removes it."""
    from slime_dsa.run_dir import prepare_model_dir  # noqa: PLC0415

    source = prepare_model_dir(load_recipe(None, ["model.preset=tiny"]), tmp_path / "scratch")
    leftover = tmp_path / "run" / ".initial_model.tmp-k1ll3d"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"\0" * 1024)
    assert prepare_model_dir(load_recipe(None, [f"model.path={source}"]), tmp_path / "run") == source
    assert not leftover.exists()


def test_a_reused_initial_model_takes_a_changed_index_topk(tmp_path):
    """A resumed run (or a second one in the directory) reuses run_dir/initial_model: a model.index_topk changed
    since its first start was silently ignored, engines and trainer kept the old DSA budget."""
    import json  # noqa: PLC0415

    from slime_dsa.run_dir import prepare_model_dir  # noqa: PLC0415

    def budget(*overrides: str, run: str) -> int:
        model_dir = prepare_model_dir(load_recipe(None, list(overrides)), tmp_path / run)
        return json.loads((model_dir / "config.json").read_text())["index_topk"]

    assert budget("model.preset=tiny", "model.index_topk=16", run="scratch") == 16
    assert budget("model.preset=tiny", "model.index_topk=24", run="scratch") == 24
    assert budget("model.preset=tiny", run="scratch") == 24  # null: the model's, as it is
    source = tmp_path / "scratch" / "initial_model"
    assert budget(f"model.path={source}", "model.index_topk=8", run="copy") == 8
    assert budget(f"model.path={source}", "model.index_topk=12", run="copy") == 12


def test_the_default_run_name_is_documented_as_the_run_directorys_name():
    """Without logging.run_name the W&B run is named after the run directory (the quickstart's W&B run is
    'quickstart'), but `recipe explain` said 'null = a timestamped name'."""
    from slime_dsa.config.schema import LoggingSection  # noqa: PLC0415

    doc = LoggingSection.model_fields["run_name"].description
    assert "null = the run directory's name" in doc and "run-<timestamp>" in doc
