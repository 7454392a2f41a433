"""`train --resume` with a recipe whose data.tasks or data.seed changed since the checkpoint."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow  # run_training up to Ray's start: the model, tokenizer and tasks built three times
def test_changed_tasks_or_seed_on_resume_is_one_line_before_ray(tmp_path, monkeypatch):
    """A resume whose data.tasks (a task renamed, resized) or data.seed changed was a ValueError traceback from
    TaskMixture.load_state_dict, after Ray, the engines and the trainer ranks had started."""
    import slime_dsa.orchestrator.cluster as cluster
    import slime_dsa.orchestrator.train as train
    from slime_dsa.config import load_recipe
    from slime_dsa.config.errors import UserError

    def no_ray(recipe):
        raise AssertionError("Ray started")

    checkpoint = tmp_path / "step_000002"
    checkpoint.mkdir()
    mixture = {"seed": 7, "num_drawn": 8, "tasks": [{"name": "arithmetic", "size": 40, "count": 8}]}
    (checkpoint / "orchestrator.json").write_text(json.dumps({"step": 2, "rollout": {"mixture": mixture}}))
    monkeypatch.setattr(train, "_checkpoints", lambda recipe, run_dir, resume: (None, checkpoint))
    monkeypatch.setattr(cluster, "init_ray", no_ray)
    monkeypatch.setattr(train, "check_same_model", lambda checkpoint, model_dir: None)  # it holds no weights

    def resume(*overrides: str) -> None:
        recipe = load_recipe(None, ["model.preset=tiny", "data.seed=7", "data.tasks.0.train_size=40",
                                    f"logging.run_dir={tmp_path / 'run'}", "logging.wandb_mode=disabled", *overrides])
        train.run_training(recipe, resume=True)

    with pytest.raises(UserError, match=r"^data\.tasks: the checkpoint's prompt stream was drawn from tasks \(name, "
                                        r"train prompts\) \[\('arithmetic', 40\)\], but the recipe's are "
                                        r"\[\('arith', 40\)\]: resume with the same data\.tasks$"):
        resume("data.tasks.0.name=arith")
    with pytest.raises(UserError, match=r"^data\.seed: .* seed 7, but the recipe's is 8: resume with the same"):
        resume("data.seed=8")
    with pytest.raises(AssertionError, match="Ray started"):  # the same tasks and seed go on
        resume()
