"""The driver SIGKILLed mid-step: `slime-dsa train` in a subprocess is killed, its newest checkpoint is then damaged
too, and `--resume` gives exactly the records (rewards, losses) of an uninterrupted run. The resumed run also clears
what the killed one left: its run-directory lock (taken over, with a log line) and its /dev/shm weight copy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from slime_dsa.config import load_recipe
from tests.faults.runs import ROOT, recipe_dict, records, wait_for, write_recipe

pytestmark = pytest.mark.slow

STEPS = 6  # room for the kill to land a step or two late on a loaded machine: the resume still runs >= 2 steps
COMPARED = ("rollout/reward_mean", "rollout/num_samples", "train/loss", "train/grad_norm")


def _train(recipe: Path, run_dir: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    return subprocess.Popen([sys.executable, "-m", "slime_dsa.cli", "train", str(recipe), "--set",
                             f"logging.run_dir={run_dir}", *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _checkpoints(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "checkpoints").glob("step_*"))


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory, ray_cluster):
    """A reference run in this process; the same recipe in a `slime-dsa train` subprocess SIGKILLed after step 2, its
    newest checkpoint damaged, then `--resume`d in another subprocess."""
    from slime_dsa.orchestrator.train import run_training

    tmp_path = tmp_path_factory.mktemp("driver_kill")
    recipe = write_recipe(tmp_path / "recipe.yaml", recipe_dict(STEPS, engines=1))
    reference = run_training(load_recipe(recipe, [f"logging.run_dir={tmp_path / 'reference'}"]))

    run_dir = tmp_path / "run"
    driver = _train(recipe, run_dir)
    try:
        # Two published checkpoints, not two records: step 2's record reaches metrics.jsonl just before its checkpoint
        assert wait_for(lambda: len(_checkpoints(run_dir)) >= 2, 300), driver.stderr.read() if driver.poll() else ""
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and every process of its session, Ray's included
        driver.wait()
    left = {"lock": (run_dir / ".lock").read_text().split()[0],
            "shm": list(Path("/dev/shm").glob(f"slime-dsa-weights-{driver.pid}-*"))}
    checkpoints = _checkpoints(run_dir)
    newest = checkpoints[-1] / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:-64])  # and the newest checkpoint is damaged

    resumed = _train(recipe, run_dir, "--resume")
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    return {"reference": reference, "run_dir": run_dir, "driver": driver.pid, "left": left,
            "damaged": checkpoints[-1], "out": out, "err": err}


def test_resume_after_a_sigkilled_driver_gives_the_uninterrupted_records(killed_and_resumed, figures):
    run = killed_and_resumed
    assert f"run finished: {run['run_dir']}" in run["out"]
    got, want = records(run["run_dir"]), records(run["reference"])
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for a, b in zip(got, want):
        assert {k: a[k] for k in COMPARED} == {k: b[k] for k in COMPARED}, a["step"]
    assert f"checkpoint {run['damaged']} skipped" in (run["run_dir"] / "train.log").read_text()
    figures["driver_killed"] = {"records_compared": len(got), "identical": sum(
        {k: a[k] for k in COMPARED} == {k: b[k] for k in COMPARED} for a, b in zip(got, want)),
        "resumed_from_step": int(run["damaged"].name.split("_")[1]) - 1, "fields": list(COMPARED)}


def test_resume_clears_what_the_killed_run_left(killed_and_resumed):
    run = killed_and_resumed
    assert run["left"]["lock"] == str(run["driver"])  # the lock file still named the dead driver
    log = (run["run_dir"] / "train.log").read_text()
    assert f"pid {run['driver']}" in log and "took over the lock" in log
    for left in run["left"]["shm"]:
        assert not left.exists() and f"removed {left}" in log


def test_the_console_shows_one_line_per_step(killed_and_resumed):
    """The README's promise: between the first and the last step line, the console shows only step lines (the INFO
    messages of each step go to train.log)."""
    lines = [line for line in killed_and_resumed["err"].splitlines() if line.strip()]
    steps = [i for i, line in enumerate(lines) if line.startswith("step ")]
    assert len(steps) >= 2
    assert all(line.startswith("step ") for line in lines[steps[0]:steps[-1] + 1]), lines[steps[0]:steps[-1] + 1]
