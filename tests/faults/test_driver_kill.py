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

STEPS = 4
COMPARED = ("rollout/reward_mean", "rollout/num_samples", "train/loss", "train/grad_norm")


def _train(recipe: Path, run_dir: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    return subprocess.Popen([sys.executable, "-m", "slime_dsa.cli", "train", str(recipe), "--set",
                             f"logging.run_dir={run_dir}", *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_resume_after_a_sigkilled_driver_gives_the_uninterrupted_records(tmp_path, ray_cluster):
    from slime_dsa.orchestrator.train import run_training

    recipe = write_recipe(tmp_path / "recipe.yaml", recipe_dict(STEPS, engines=1))
    reference = run_training(load_recipe(recipe, [f"logging.run_dir={tmp_path / 'reference'}"]))

    run_dir = tmp_path / "run"
    driver = _train(recipe, run_dir)
    try:
        assert wait_for(lambda: len(records(run_dir)) >= 2, 300), driver.stderr.read() if driver.poll() else ""
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and every process of its session, Ray's included
        driver.wait()
    assert (run_dir / ".lock").read_text().split()[0] == str(driver.pid)  # left held by a dead pid
    shm_left = list(Path("/dev/shm").glob(f"slime-dsa-weights-{driver.pid}-*"))
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    newest = checkpoints[-1] / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:-64])  # and the newest checkpoint is damaged

    resumed = _train(recipe, run_dir, "--resume")
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    assert f"run finished: {run_dir}" in out
    log = (run_dir / "train.log").read_text()
    assert f"pid {driver.pid}" in log and "took over the lock" in log
    assert f"checkpoint {checkpoints[-1]} skipped" in log
    for left in shm_left:
        assert not left.exists() and f"removed {left}" in log

    got, want = records(run_dir), records(reference)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for a, b in zip(got, want):
        assert {k: a[k] for k in COMPARED} == {k: b[k] for k in COMPARED}, a["step"]
