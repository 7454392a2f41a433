"""One run per run directory (slime_dsa/run_lock.py): a second run fails at once naming the directory and the
holder's pid; a lock left by a SIGKILLed run is taken over with a log line; a clean exit releases it. And what a
person reads when a run cannot go on: `--resume` of a finished run, and Ctrl-C (the steps since the last checkpoint)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slime_dsa.cli import main
from slime_dsa.config import load_recipe
from slime_dsa.config.errors import UserError
from slime_dsa.orchestrator.step import StepProgress
from slime_dsa.run_dir import held_lock, open_run_dir
from slime_dsa.run_lock import RunLock

ROOT = Path(__file__).resolve().parents[1]
BASE = str(ROOT / "recipes" / "base.yaml")

HOLD = textwrap.dedent("""
    import sys, time
    from slime_dsa.config import load_recipe
    from slime_dsa.run_dir import open_run_dir
    with open_run_dir(load_recipe(None, ["logging.run_dir=" + sys.argv[1]]), "job.log"):
        print("locked", flush=True)
        time.sleep(120)
""")


def _holder(run_dir: Path) -> subprocess.Popen:
    """A process that holds `run_dir` (open_run_dir) until killed; returns once it holds it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_in_the_same_directory_fails_at_once_naming_it_and_the_pid(tmp_path, capsys):
    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    try:
        with pytest.raises(UserError) as err:
            with open_run_dir(load_recipe(None, [f"logging.run_dir={run_dir}"]), "train.log"):
                pass
        assert str(run_dir) in str(err.value) and f"pid {holder.pid}" in str(err.value)
        # the command line: one line, exit code 2, before Ray or any engine starts
        assert main(["train", BASE, "--set", f"logging.run_dir={run_dir}"]) == 2
        _, stderr = capsys.readouterr()
        line = stderr.strip().splitlines()[-1]
        assert line.startswith("slime-dsa: error: run directory") and f"pid {holder.pid}" in line
        assert "Traceback" not in stderr
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_left_by_a_sigkilled_run_is_taken_over_with_a_log_line(tmp_path, caplog):
    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    with caplog.at_level(logging.WARNING, logger="slime_dsa.run_lock"):
        with open_run_dir(load_recipe(None, [f"logging.run_dir={run_dir}"]), "train.log"):
            assert held_lock(run_dir).held
            assert (run_dir / ".lock").read_text().split()[0] == str(os.getpid())
    assert any(f"pid {holder.pid}" in r.getMessage() and "took over" in r.getMessage() for r in caplog.records)
    # released on exit: the next run takes it without a word
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slime_dsa.run_lock"), RunLock(run_dir) as lock:
        assert lock.held
    assert not caplog.records and held_lock(run_dir) is None


def _finished_checkpoint(run_dir: Path, step: int) -> Path:
    import torch
    from safetensors.torch import save_file

    ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
    ckpt.mkdir(parents=True)
    save_file({"w": torch.zeros(4)}, ckpt / "model.safetensors")
    rollout = {"mixture": {}, "next_sample_index": 0, "next_group_id": 0}
    (ckpt / "orchestrator.json").write_text(json.dumps({"step": step, "rollout": rollout}))
    return ckpt


def test_resume_of_a_finished_run_says_how_to_go_further(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _finished_checkpoint(run_dir, 400)
    assert main(["train", BASE, "--resume", "--set", f"logging.run_dir={run_dir}", "--set", "trainer.num_steps=400"]) == 2
    _, stderr = capsys.readouterr()
    line = stderr.strip().splitlines()[-1]
    assert "already at step 400" in line and "raise trainer.num_steps" in line and "trainer.num_steps=800" in line
    assert "Traceback" not in stderr and not (run_dir / "initial_model").exists()  # refused before any work


def test_resume_where_every_checkpoint_is_damaged_is_one_line_and_keeps_them(tmp_path, capsys, monkeypatch):
    """--resume found checkpoints but none intact: it started afresh with a warning, overwrote the damaged ones (a
    file still being copied back, say) with its own saves and dropped metrics.jsonl's records."""
    def started(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr("slime_dsa.run_dir.prepare_model_dir", started)
    run_dir = tmp_path / "run"
    ckpt = _finished_checkpoint(run_dir, 3)
    (ckpt / "model.safetensors").write_bytes(b"truncated")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["train", BASE, "--resume", "--set", f"logging.run_dir={run_dir}", "--set", "trainer.num_steps=5"]) == 2
    _, stderr = capsys.readouterr()
    line = stderr.strip().splitlines()[-1]
    assert "no intact checkpoint" in line and str(ckpt) in line and "model.safetensors" in line, stderr
    assert "Traceback" not in stderr and (ckpt / "model.safetensors").read_bytes() == b"truncated"
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'


RUNNING = textwrap.dedent("""
    import asyncio, sys
    from slime_dsa.config import load_recipe
    from slime_dsa.orchestrator import train

    async def running(*args, **kwargs):
        print("running", flush=True)
        await asyncio.sleep(120)

    train._run = running  # the run's loop, without Ray, engines or trainers
    train.run_training(load_recipe(None, sys.argv[1:]))
""")


@pytest.mark.slow  # a subprocess that imports torch: seconds
@pytest.mark.parametrize("shared", ["outside", "inside_the_first_run_dir"])
def test_a_second_run_on_a_running_runs_checkpoint_dir_is_refused_naming_the_pid(tmp_path, capsys, monkeypatch,
                                                                                 shared):
    """checkpoint.dir was locked only while orphans were removed at the start: a second run on it (another
    logging.run_dir) resumed from the first's checkpoints, removed its save in progress as an orphan and wrote the
    same step_N directories."""
    def started(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr("slime_dsa.run_dir.prepare_model_dir", started)
    ckpt_dir = tmp_path / "shared" if shared == "outside" else tmp_path / "first" / "checkpoints"
    first = [f"logging.run_dir={tmp_path / 'first'}"] + ([f"checkpoint.dir={ckpt_dir}"] if shared == "outside" else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", RUNNING, *first], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "running"
        assert main(["train", BASE, "--resume", "--set", f"logging.run_dir={tmp_path / 'second'}",
                     "--set", f"checkpoint.dir={ckpt_dir}"]) == 2
        _, stderr = capsys.readouterr()
        line = stderr.strip().splitlines()[-1]
        says = f"slime-dsa: error: checkpoint.dir {ckpt_dir} is in use by another run (pid {holder.pid}"
        assert line.startswith(says), stderr
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("rollout", [None, [], {"next_sample_index": 0, "next_group_id": 0}])
def test_resume_from_an_orchestrator_json_edited_by_hand_is_one_line(tmp_path, capsys, rollout):
    """orchestrator.json without its rollout state (removed by hand) passed validation, then the resume was a
    KeyError traceback ('rollout', 'mixture')."""
    run_dir = tmp_path / "run"
    ckpt = _finished_checkpoint(run_dir, 3)
    state = {"step": 3} if rollout is None else {"step": 3, "rollout": rollout}
    (ckpt / "orchestrator.json").write_text(json.dumps(state))
    assert main(["train", BASE, "--resume", "--set", f"logging.run_dir={run_dir}", "--set", "trainer.num_steps=5"]) == 2
    _, stderr = capsys.readouterr()
    line = stderr.strip().splitlines()[-1]
    assert str(ckpt / "orchestrator.json") in line and "rollout" in line and "Traceback" not in stderr, stderr
    assert not (run_dir / "initial_model").exists()  # refused before any work


def test_resume_with_another_model_is_one_line_naming_the_tensor(tmp_path, capsys, monkeypatch):
    """model.path or model.preset changed since the checkpoint: the trainer ranks' load_state_dict failed with a
    118-line RayTaskError (every size mismatch) once Ray, engines and ranks had started."""
    import shutil

    def went_on(*args, **kwargs):
        raise AssertionError("the run went on")

    monkeypatch.setattr("slime_dsa.data.prompts.build_tasks", went_on)
    run_dir = tmp_path / "run"
    ckpt = _finished_checkpoint(run_dir, 3)
    shutil.copy(ROOT / "recipes" / "assets" / "quickstart-sft" / "model.safetensors", ckpt / "model.safetensors")
    assert main(["train", BASE, "--resume", "--set", f"logging.run_dir={run_dir}", "--set", "trainer.num_steps=5",
                 "--set", "logging.wandb_mode=disabled"]) == 2
    _, stderr = capsys.readouterr()
    line = stderr.strip().splitlines()[-1]
    assert str(ckpt) in line and "model.safetensors holds tensor " in line and "Traceback" not in stderr, stderr


def test_a_run_directory_that_cannot_be_written_is_one_line_naming_the_key(tmp_path, capsys):
    # /proc takes no new directories, for root too (as a read-only filesystem or a directory without write permission)
    unwritable = "/proc/slime-dsa-no-such-dir/run"
    for key, more in (("logging.run_dir", []), ("checkpoint.dir", ["--set", f"logging.run_dir={tmp_path / 'run'}"])):
        assert main(["train", BASE, "--set", f"{key}={unwritable}", *more]) == 2
        _, stderr = capsys.readouterr()
        assert "Traceback" not in stderr
        assert stderr.strip().splitlines()[-1] == (
            f"slime-dsa: error: {key}: cannot write {unwritable}: No such file or directory")


def test_ctrl_c_says_which_steps_since_the_last_checkpoint_are_lost(tmp_path):
    ckpts = tmp_path / "checkpoints"
    assert StepProgress(current=57, saved=50).lost_line(ckpts) == (
        f"interrupted during step 57: steps 51-57 since the checkpoint of step 50 in {ckpts} are lost; "
        "--resume continues from step 50")
    assert "step 1 since the start (no checkpoint yet)" in StepProgress(current=1).lost_line(ckpts)
    assert StepProgress(current=50, saved=50).lost_line(ckpts).startswith("no step lost")


def test_ctrl_c_during_a_checkpoint_save_counts_the_checkpoint_it_finished(tmp_path):
    # the save runs in a thread that finishes after the signal stopped the loop: the line reads the directory
    _finished_checkpoint(tmp_path, 3)
    assert StepProgress(current=3, saved=0).lost_line(tmp_path / "checkpoints") == (
        "no step lost (the last checkpoint is step 3)")
    line = StepProgress(current=5, saved=0).lost_line(tmp_path / "checkpoints")
    assert "steps 4-5 since the checkpoint of step 3" in line and line.endswith("--resume continues from step 3")


def test_the_command_line_prints_the_interruption_in_one_line(capsys, monkeypatch):
    from slime_dsa.commands import train

    def interrupted(args):
        raise KeyboardInterrupt("interrupted during step 3: steps 3 since ...")

    monkeypatch.setattr(train, "run", interrupted)
    assert main(["train", BASE]) == 130
    assert capsys.readouterr().err == "slime-dsa: interrupted: interrupted during step 3: steps 3 since ...\n"


@pytest.mark.parametrize(("megatron_ranks", "overrides", "says"), [
    (2, ["trainer.backend=fsdp"], "was written by trainer.backend megatron, and this run's trainer.backend is 'fsdp'"),
    (None, ["trainer.backend=megatron"], "was written by trainer.backend fsdp or deepspeed, and this run's "
                                         "trainer.backend is 'megatron'"),
    (2, ["trainer.backend=megatron", "trainer.num_workers=1"], "was written by 2 ranks with trainer.megatron"),
    (2, ["trainer.backend=megatron", "trainer.num_workers=2", "trainer.megatron.expert_parallel=2"],
     "'expert_parallel': 1"),
])
def test_resume_with_another_backend_or_ranks_is_one_line_before_any_work(tmp_path, capsys, monkeypatch,
                                                                          megatron_ranks, overrides, says):
    """A Megatron checkpoint resumed by fsdp (or the reverse, or by other ranks) started Ray, engines and trainers,
    then died with a trainer rank's FileNotFoundError (optimizer.safetensors, megatron/rank0.json) or ValueError."""
    monkeypatch.setattr("slime_dsa.config.paths._installed", lambda module: True)  # megatron-core or not
    run_dir = tmp_path / "run"
    ckpt = _finished_checkpoint(run_dir, 3)
    if megatron_ranks:
        (ckpt / "megatron").mkdir()
        layout = {"optimizer": "torch", "world_size": megatron_ranks,
                  "sizes": {"tensor_parallel": 1, "pipeline_parallel": 1, "expert_parallel": 1, "context_parallel": 1}}
        (ckpt / "megatron" / "rank0.json").write_text(json.dumps(layout))
    sets = [arg for o in [f"logging.run_dir={run_dir}", "trainer.num_steps=5", *overrides] for arg in ("--set", o)]
    assert main(["train", BASE, "--resume", *sets]) == 2
    _, stderr = capsys.readouterr()
    line = stderr.strip().splitlines()[-1]
    assert says in line and str(ckpt) in line, stderr
    assert "Traceback" not in stderr and not (run_dir / "initial_model").exists()  # refused before any work


@pytest.mark.parametrize(("saved_ranks", "warned"), [(2, True), (1, False)])
def test_resume_with_another_number_of_fsdp_ranks_warns_that_it_is_not_exact(tmp_path, caplog, saved_ranks, warned):
    """fsdp and deepspeed checkpoints hold full tensors, so another rank count resumes, but the batch splits
    differently and the new ranks' RNG streams start fresh: said, where the README promised exactness."""
    from slime_dsa.config import load_recipe
    from slime_dsa.orchestrator.train import check_checkpoint_layout

    for rank in range(saved_ranks):
        (tmp_path / f"rng_rank{rank}.safetensors").write_bytes(b"")
    with caplog.at_level("WARNING"):
        check_checkpoint_layout(load_recipe(BASE, ["trainer.num_workers=1"]), tmp_path)
    assert ("written by 2 trainer ranks and this run has trainer.num_workers 1" in caplog.text) == warned


@pytest.mark.parametrize("overrides", [["cluster.num_gpus_per_engine=0.5"], ["cluster.num_gpus_per_trainer=1"],
                                       ["algorithm.name=sao", "critic.placement=separate",
                                        "critic.num_gpus_per_worker=1"]])
def test_a_gpu_recipe_on_a_machine_without_gpus_is_one_line_before_any_work(tmp_path, capsys, monkeypatch,
                                                                             overrides):
    """recipes/gpu_single.yaml on a CPU machine started a local Ray cluster whose autoscaler printed 'No available
    node types can fulfill resource request {'GPU': 0.5}' every 35 s while the run waited for ever."""
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)

    def no_ray(recipe):
        raise AssertionError("Ray started")

    monkeypatch.setattr("slime_dsa.orchestrator.cluster.init_ray", no_ray)
    run_dir = tmp_path / "run"
    sets = [arg for o in [f"logging.run_dir={run_dir}", *overrides] for arg in ("--set", o)]
    assert main(["train", BASE, *sets]) == 2
    _, stderr = capsys.readouterr()
    line = stderr.strip().splitlines()[-1]
    key = overrides[-1].split("=")[0]
    assert line.startswith(f"slime-dsa: error: {key} (") and "this machine has no GPU" in line, stderr
    assert "Traceback" not in stderr and not (run_dir / "initial_model").exists()  # refused before any work
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    from slime_dsa.orchestrator.cluster import check_local_gpus
    check_local_gpus(load_recipe(BASE, [o for o in overrides]))  # a GPU: nothing to refuse
    check_local_gpus(load_recipe(BASE, [*overrides, "cluster.address=auto"]))  # a cluster's GPUs: Ray's to find
