"""A trainer rank SIGKILLed mid-run: the run stops with one line naming the newest checkpoint (no traceback), and
`--resume` from it finishes the run. Real parts: the session's Ray cluster, two FSDP ranks over gloo, embedded
engines over HTTP; the rank is found among this session's processes that appeared with the run."""

from __future__ import annotations

import os
import threading

import pytest

from slime_dsa.config import load_recipe
from tests.faults.runs import descendants, processes_named, recipe_dict, records, sigkill, wait_for, write_recipe

pytestmark = pytest.mark.slow

STEPS = 4


def test_a_killed_trainer_rank_stops_the_run_in_one_line_and_resume_finishes_it(tmp_path, ray_cluster, figures):
    from slime_dsa.config.errors import UserError
    from slime_dsa.orchestrator.train import run_training

    path = write_recipe(tmp_path / "recipe.yaml", recipe_dict(STEPS, engines=1, workers=2))
    run_dir = tmp_path / "run"
    before = set(processes_named("ray::FSDPWorker", descendants(os.getpid())))
    killed: list[int] = []

    def kill() -> None:
        if wait_for(lambda: len(records(run_dir)) >= 2, 300):
            ranks = [p for p in processes_named("ray::FSDPWorker", descendants(os.getpid())) if p not in before]
            if ranks:
                killed.append(ranks[-1])
                sigkill(ranks[-1])

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    with pytest.raises(UserError) as err:
        run_training(load_recipe(path, [f"logging.run_dir={run_dir}"]))
    killer.join(5)
    assert killed
    message = str(err.value)
    assert "\n" not in message and message.startswith("a trainer rank died at step")
    assert "the newest checkpoint is" in message and "--resume continues from it" in message

    run_training(load_recipe(path, [f"logging.run_dir={run_dir}"]), resume=True)
    assert [r["step"] for r in records(run_dir)] == list(range(1, STEPS + 1))
    figures["trainer_rank_killed"] = {"line": message, "resumed_to_step": STEPS}
