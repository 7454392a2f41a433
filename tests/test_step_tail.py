"""The tail every RL step shares (orchestrator/step.after_step): an evaluation is logged on the step that ran it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace


def test_an_evaluation_on_a_step_off_log_every_is_logged():
    """With logging.eval_every 3 and log_every 2, step 3 evaluated (greedy generation on every held-out prompt) and
    then dropped its eval/ metrics: only steps 2, 4, ... and the last reached metrics.jsonl and W&B."""
    from slime_dsa.config.schema import RecipeConfig
    from slime_dsa.orchestrator.step import after_step

    recipe = RecipeConfig.model_validate({
        "data": {"tasks": [{"kind": "arithmetic", "eval_size": 4}]},
        "logging": {"log_every": 2, "eval_every": 3}, "trainer": {"num_steps": 10}})
    logged: list[tuple[int, dict]] = []

    async def evaluate() -> dict[str, float]:
        return {"eval/pass@1": 0.5}

    run = SimpleNamespace(recipe=recipe, engine_stats=None, driver_gc=None, manager=SimpleNamespace(evaluate=evaluate),
                          metrics_log=SimpleNamespace(log=lambda m, step: logged.append((step, dict(m)))))
    for step in range(4):
        asyncio.run(after_step(run, step, {"train/loss": 0.1}))
    assert [step for step, _ in logged] == [2, 3, 4]
    assert [step for step, m in logged if "eval/pass@1" in m] == [3]
