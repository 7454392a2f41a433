"""Faults in the rollout side of a real run: an engine process SIGKILLed mid-run, a reward that hangs and one that
raises (one run covers the three), and every engine lost (an emergency checkpoint and one line).

Real parts: the session's local Ray cluster, embedded engines over HTTP on 127.0.0.1, an FSDP rank over gloo, the
reward pool's worker processes. The engine is found by the port its run announced, among this session's processes.
"""

from __future__ import annotations

import threading

import pytest

from slime_dsa.config import load_recipe
from tests.faults.runs import (descendants, engine_urls, pid_listening_on, recipe_dict, records, sigkill, wait_for,
                               write_recipe)

pytestmark = pytest.mark.slow

STEPS, PROMPTS, N = 7, 4, 4  # after the kill at step 1, six steps for the replacement to start on a loaded machine


def _kill_an_engine_after(run_dir, after_records: int, out: dict) -> threading.Thread:
    """A thread that SIGKILLs the run's first engine once metrics.jsonl has `after_records` records (mid-run)."""
    import os

    def kill() -> None:
        if not wait_for(lambda: len(records(run_dir)) >= after_records, 300):
            return
        urls = engine_urls(run_dir / "train.log")
        import requests  # the run's engines take commands only with the run's key: a local process has none

        out["keyless_pause"] = requests.post(urls[-1] + "/pause_generation", json={"mode": "abort"}, timeout=10).status_code
        pid = pid_listening_on(int(urls[0].rsplit(":", 1)[1]), descendants(os.getpid()))
        if pid is not None:
            out["url"], out["pid"] = urls[0], pid
            sigkill(pid)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def _run_killing_an_engine(root, recipe: dict, after_step: int) -> tuple:
    """run_training on `recipe` in root/run while an engine is killed after `after_step`: (run_dir, the kill)."""
    from slime_dsa.orchestrator.train import run_training

    path = write_recipe(root / "recipe.yaml", recipe)
    run_dir = root / "run"
    killed: dict = {}
    killer = _kill_an_engine_after(run_dir, after_step, killed)
    run_training(load_recipe(path, [f"logging.run_dir={run_dir}"]))
    killer.join(5)
    return run_dir, killed


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory, ray_cluster):
    root = tmp_path_factory.mktemp("engine_loss")
    recipe = recipe_dict(STEPS, engines=2, rollout__reward_timeout_s=2.0,
                         data__tasks=[{"kind": "arithmetic", "eval_size": 8,
                                       "reward_fn": "tests.plugins.rewards:hangs_or_raises"}])
    return _run_killing_an_engine(root, recipe, after_step=1)


def test_a_killed_engine_is_dropped_replaced_and_the_run_finishes(faulty_run):
    run_dir, killed = faulty_run
    assert killed, "no engine was killed"
    assert [r["step"] for r in records(run_dir)] == list(range(1, STEPS + 1))
    log = (run_dir / "train.log").read_text()
    assert f"engine {killed['url']} lost" in log
    assert f"engine {killed['url']} replaced by" in log and "joined" in log
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-5 for r in records(run_dir))  # weights stayed in sync


def test_the_runs_engines_refuse_a_process_without_the_runs_key(faulty_run):
    _, killed = faulty_run
    assert killed["keyless_pause"] == 401


def test_no_sample_is_lost(faulty_run, figures):
    """Every sample of every step is accounted for: trained on, or counted as failed (its engine died under it)."""
    run_dir, _ = faulty_run
    rs = records(run_dir)
    for r in rs:
        assert r["rollout/num_samples"] == PROMPTS * N
        assert r["rollout/failed_samples"] <= PROMPTS * N
    log = (run_dir / "train.log").read_text()
    figures["engine_killed"] = {
        "steps": len(rs), "samples_started": STEPS * PROMPTS * N, "samples_recorded": sum(r["rollout/num_samples"] for r in rs),
        "samples_failed": sum(r["rollout/failed_samples"] for r in rs), "samples_lost": STEPS * PROMPTS * N - sum(
            r["rollout/num_samples"] for r in rs), "engines_lost": log.count(" lost ("), "engines_replaced": log.count(" replaced by "),
        "reward_timeouts": sum(r["rollout/reward_timeouts"] for r in rs),
        "reward_failures": sum(r["rollout/reward_failures"] for r in rs),
        "max_rollout_time_s": max(r["perf/rollout_time_s"] for r in rs)}


def test_a_hanging_and_a_raising_reward_cost_their_samples_only(faulty_run):
    run_dir, _ = faulty_run
    rs = records(run_dir)
    assert sum(r["rollout/reward_timeouts"] for r in rs) >= 1 and sum(r["rollout/reward_failures"] for r in rs) >= 1
    assert all(r["perf/rollout_time_s"] < 60 for r in rs)  # a hung reward waits out its 2 s deadline, no more


def test_every_engine_lost_writes_an_emergency_checkpoint_and_one_line(tmp_path, ray_cluster, figures):
    from slime_dsa.checkpoint.training import CheckpointManager, read_orchestrator_state
    from slime_dsa.config.errors import UserError
    from slime_dsa.orchestrator.train import run_training

    recipe = recipe_dict(STEPS, engines=1, rollout__restart_dead_engines=False, checkpoint__save_every=100)
    path = write_recipe(tmp_path / "recipe.yaml", recipe)
    run_dir = tmp_path / "run"
    killed: dict = {}
    killer = _kill_an_engine_after(run_dir, 2, killed)
    with pytest.raises(UserError) as err:
        run_training(load_recipe(path, [f"logging.run_dir={run_dir}"]))
    killer.join(5)
    message = str(err.value)
    assert "\n" not in message and message.startswith("rollout engines lost at step")
    assert "emergency checkpoint" in message and "--resume" in message
    newest = CheckpointManager(run_dir / "checkpoints").latest()
    assert newest is not None and str(newest) in message
    assert read_orchestrator_state(newest)["step"] >= 2  # the steps trained before the loss are kept
    figures["every_engine_lost"] = {"line": message, "emergency_checkpoint_step": read_orchestrator_state(newest)["step"]}


@pytest.mark.parametrize("algorithm", ["grpo", "async_reinforce"])
def test_the_only_engine_lost_is_replaced_and_the_run_finishes(algorithm, tmp_path, ray_cluster):
    """One engine (recipes/async_reinforce.yaml's setting) killed mid-run: with rollout.restart_dead_engines the run
    waits for its replacement (at the weight push, or the next step) instead of stopping as if none were coming."""
    # Steps of ~0.1 s (grpo) and ~50 ms (async): enough of them that the kill, which the killer thread issues a moment
    # after step 2's record on a loaded machine, lands with steps to go (at 5 grpo steps it once landed in the last)
    steps = 20 if algorithm == "grpo" else 100
    recipe = recipe_dict(steps, engines=1, checkpoint__save_every=100, algorithm__name=algorithm)
    run_dir, killed = _run_killing_an_engine(tmp_path, recipe, after_step=2)
    assert killed, "no engine was killed"
    assert [r["step"] for r in records(run_dir)] == list(range(1, steps + 1))
    log = (run_dir / "train.log").read_text()
    assert f"engine {killed['url']} replaced by" in log and "joined" in log
