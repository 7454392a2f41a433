"""Run checkpoints: a damaged newest checkpoint is skipped with one WARNING for the newest intact one, the
temporary directories a killed save left behind are removed at the next start, and a rank resumes exactly where a
trained parameter has no AdamW state yet (real FSDP2 and DeepSpeed ranks of one over gloo, the tiny preset)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from slime_dsa.checkpoint.training import CheckpointManager


def _write(tmp: Path) -> None:
    """What a trainer writes, in small."""
    save_file({"w": torch.arange(64, dtype=torch.float32)}, tmp / "model.safetensors")
    save_file({"w/exp_avg": torch.zeros(64)}, tmp / "optimizer.safetensors")
    (tmp / "trainer.json").write_text(json.dumps({"step": 1}))
    (tmp / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa"}))


@pytest.fixture
def manager(tmp_path) -> CheckpointManager:
    ckpts = CheckpointManager(tmp_path / "checkpoints", keep_last=0)
    for step in (1, 2, 3):
        ckpts.save(step, _write, {"rollout": {"next": step}})
    return ckpts


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


DAMAGE = [
    (lambda d: (d / "orchestrator.json").unlink(), "orchestrator.json is missing"),
    (lambda d: (d / "orchestrator.json").write_text('{"step": 3, "rol'), "orchestrator.json is not valid JSON"),
    (lambda d: (d / "model.safetensors").unlink(), "model.safetensors is missing"),
    (lambda d: _truncate(d / "model.safetensors"), "model.safetensors is"),
    (lambda d: (d / "optimizer.safetensors").write_bytes(b"\x00" * 300), "optimizer.safetensors"),
    (lambda d: (d / "trainer.json").write_text("{not json!}"), "trainer.json is not valid JSON"),  # same size
    (lambda d: (d / "trainer.json").unlink(), "trainer.json is missing"),
]


@pytest.mark.parametrize("damage, problem", DAMAGE, ids=[p for _, p in DAMAGE])
def test_latest_skips_a_damaged_checkpoint_with_one_warning(manager, caplog, damage, problem):
    newest = manager.path_for(3)
    assert manager.latest() == newest
    damage(newest)
    with caplog.at_level(logging.WARNING, logger="slime_dsa.checkpoint.training"):
        assert manager.latest() == manager.path_for(2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(newest) in warnings[0] and problem in warnings[0], warnings


def test_latest_is_none_when_every_checkpoint_is_damaged(manager, caplog):
    for step in (1, 2, 3):
        (manager.path_for(step) / "orchestrator.json").unlink()
    with caplog.at_level(logging.WARNING, logger="slime_dsa.checkpoint.training"):
        assert manager.latest() is None
    assert len(caplog.records) == 3


def test_orphan_temporary_directories_are_removed_at_start(manager, caplog):
    orphan = manager.directory / ".step_000004.tmp-abc123"
    orphan.mkdir()
    (orphan / "model.safetensors").write_bytes(b"partial")
    with caplog.at_level(logging.INFO, logger="slime_dsa.checkpoint.training"):
        removed = manager.remove_orphans(SimpleNamespace(held=True))
    assert removed == [orphan] and not orphan.exists()
    assert any(str(orphan) in r.getMessage() for r in caplog.records)
    assert manager.latest() == manager.path_for(3)


def test_orphans_are_removed_only_under_the_run_directory_lock(manager):
    """Another run's save in progress looks like an orphan: only the holder of the run directory's lock removes them."""
    busy = manager.directory / ".step_000004.tmp-other-run"
    busy.mkdir()
    with pytest.raises(RuntimeError, match="lock"):
        manager.remove_orphans(SimpleNamespace(held=False))
    assert busy.exists()


# The start of a subprocess script: kill_around_rename(marker, how, when) makes the process die by os._exit(9) just
# before or just after the rename whose source path holds `marker` (no except or finally runs, as in a real kill):
# how "swap", durable.publish_over's swap of the new directory with the old (renameat2), else "rename aside", the
# os.replace of its fallback for filesystems that cannot swap (the swap then reports that it cannot).
KILL_AROUND_RENAME = """
import errno, os
import slime_dsa.durable as durable

def kill_around_rename(marker, how, when):
    real_replace, real_exchange = os.replace, durable._renameat2_exchange

    def around(rename, source, *args, **kwargs):
        publishing = marker in str(source)
        if publishing and when == "before":
            os._exit(9)
        result = rename(source, *args, **kwargs)
        if publishing and when == "after":
            os._exit(9)
        return result

    os.replace = lambda source, target, **kwargs: around(real_replace, source, target, **kwargs)
    swap = lambda a, b: around(real_exchange, a, b)
    durable._renameat2_exchange = swap if how == "swap" else lambda a, b: errno.EINVAL
"""
HOW = ["swap", "rename aside"]

# A save of a step that exists, killed just before or just after the rename of its temporary directory into place.
RESAVE_KILLED = KILL_AROUND_RENAME + """
import sys
from pathlib import Path
from slime_dsa.checkpoint.training import CheckpointManager
from tests.test_checkpoints import _write

directory, how, when = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
kill_around_rename(".step_000003.tmp-", how, when)
CheckpointManager(directory, keep_last=0).save(3, _write, {"rollout": {"next": 33}})
"""


def fail_rename(monkeypatch, marker: str, how: str) -> None:
    """The rename that publishes a directory whose temporary name holds `marker` fails with EIO (a full disk, a bad
    disk): the swap when `how` is "swap", else the os.replace of the fallback (the swap reporting it cannot)."""
    import errno
    import os

    import slime_dsa.durable as durable

    real_replace, real_exchange = os.replace, durable._renameat2_exchange

    def replace(source, target, **kwargs):
        if marker in str(source):
            raise OSError(errno.EIO, "Input/output error")
        real_replace(source, target, **kwargs)

    def exchange(a, b):
        return (errno.EIO if marker in str(a) else real_exchange(a, b)) if how == "swap" else errno.EINVAL

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(durable, "_renameat2_exchange", exchange)


def _rollout_next(checkpoint: Path) -> int:
    return json.loads((checkpoint / "orchestrator.json").read_text())["rollout"]["next"]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize(("when", "expected_next"), [("before", 3), ("after", 33)])
def test_a_resave_killed_around_its_rename_leaves_the_old_checkpoint_or_the_new(manager, how, when, expected_next):
    """A step saved again and killed just before its new directory is renamed into place: the next start's
    remove_orphans keeps or puts back the old one; killed just after: the new one stays and the old one is removed.
    Before, the old one was deleted before the rename: a kill there lost the step (latest() fell back to step 2)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", RESAVE_KILLED, str(manager.directory), how, when], cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 9, done.stderr
    manager.remove_orphans(SimpleNamespace(held=True))
    assert manager.latest() == manager.path_for(3)
    assert _rollout_next(manager.path_for(3)) == expected_next
    assert sorted(p.name for p in manager.directory.iterdir()) == ["step_000001", "step_000002", "step_000003"]


@pytest.mark.parametrize("how", HOW)
def test_a_resave_whose_rename_fails_keeps_the_old_checkpoint(manager, monkeypatch, how):
    """A save of an existing step whose rename into place fails (a full disk, EIO): the error reaches the caller and
    the old checkpoint of that step is still there, whole. Before, it had been deleted first."""
    fail_rename(monkeypatch, ".step_000003.tmp-", how)
    with pytest.raises(OSError, match="Input/output"):
        manager.save(3, _write, {"rollout": {"next": 33}})
    assert manager.latest() == manager.path_for(3) and _rollout_next(manager.path_for(3)) == 3
    assert sorted(p.name for p in manager.directory.iterdir()) == ["step_000001", "step_000002", "step_000003"]


# A save that prunes step 1 (keep_last=2), killed by os._exit in a subprocess after the prune deleted one file of it.
PRUNE_KILLED = """
import os, shutil, sys
from pathlib import Path
from slime_dsa.checkpoint import training
from tests.test_checkpoints import _write

def rmtree(path, *args, **kwargs):
    path = Path(path)
    if "step_000001" in path.name:
        (path / "model.safetensors").unlink()
        os._exit(9)
    shutil.rmtree(path, *args, **kwargs)

training.shutil = type("shutil", (), {"rmtree": staticmethod(rmtree)})
training.CheckpointManager(Path(sys.argv[1]), keep_last=2).save(4, _write, {"rollout": {"next": 4}})
"""


def test_a_prune_killed_midway_leaves_nothing_half_deleted_after_the_next_start(manager):
    """keep_last prunes the oldest checkpoint; a kill while it deletes its files left a half-deleted step_000001 that
    latest() skips as damaged but nothing ever removed. Now the old step is renamed to a temporary name first, which
    the next start's remove_orphans removes."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", PRUNE_KILLED, str(manager.directory)], cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 9, done.stderr
    manager.remove_orphans(SimpleNamespace(held=True))
    assert sorted(p.name for p in manager.directory.iterdir()) == ["step_000002", "step_000003", "step_000004"]


def test_export_writes_float32_routers_and_indexer_heads_as_saved(tmp_path):
    """A bf16 checkpoint holding its router weights, selection biases and indexer heads as float32 values bf16 cannot
    hold exports tensor for tensor as saved (dtype and value); so does the same model from float32 weights (as a
    trainer saves them) exported in bf16: those tensors stay float32, unrounded. Before, both rounded them through
    bf16."""
    from slime_dsa.checkpoint.hf_format import load_model, read_state_dict, save_pretrained
    from slime_dsa.checkpoint.training import export_checkpoint
    from tests.megatron_conformance import float32_tensors, save_bf16_checkpoint

    save_bf16_checkpoint(tmp_path / "mixed", float32_router=True)
    saved = read_state_dict(tmp_path / "mixed")
    kept = float32_tensors(tmp_path / "mixed")
    assert kept and all(t.dtype == torch.float32 and not torch.equal(t, t.bfloat16().float()) for t in kept.values())
    save_pretrained(load_model(tmp_path / "mixed", dtype=torch.float32), tmp_path / "float32")
    for source, dtype in (("mixed", None), ("float32", "bfloat16")):
        out = read_state_dict(export_checkpoint(tmp_path / source, tmp_path / f"out_{source}", dtype=dtype))
        assert set(out) == set(saved)
        for name, tensor in saved.items():
            assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), (source, name)


def test_export_is_readable_by_other_users_as_the_umask_allows(tmp_path):
    """mkdtemp made the export directory 0700 and safetensors its weights 0600: another user (a serving engine's)
    could not read an export. The directory and files now get the modes a plain mkdir and open would."""
    import os
    import stat

    from slime_dsa.checkpoint.training import export_checkpoint

    source = Path(__file__).resolve().parents[1] / "recipes" / "assets" / "quickstart-sft"
    umask = os.umask(0o022)
    try:
        out = export_checkpoint(source, tmp_path / "export")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir() if p.suffix != ".jinja"} == {
        name: 0o644 for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")}


@pytest.mark.parametrize("under_a_file", [False, True])
def test_export_to_a_file_is_one_user_error(tmp_path, under_a_file):
    """`export CKPT --out FILE` (or a path under a file) was a NotADirectoryError traceback."""
    from slime_dsa.checkpoint.training import export_checkpoint
    from slime_dsa.config.errors import UserError

    source = Path(__file__).resolve().parents[1] / "recipes" / "assets" / "quickstart-sft"
    (tmp_path / "notes.txt").write_text("mine")
    out = tmp_path / "notes.txt" / "model" if under_a_file else tmp_path / "notes.txt"
    with pytest.raises(UserError, match="notes.txt"):
        export_checkpoint(source, out)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]  # no temporary directory left behind


def _fsdp_worker(checkpoint: Path, frozen: tuple[str, ...] = ()):
    """An FSDP2 rank of one over gloo training the tiny preset. Its indexer trains, but without the indexer loss
    (indexer_loss_coef 0) it never gets a gradient, so AdamW holds no state for it."""
    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from trainers.base import OptimizerConfig, policy_config  # noqa: PLC0415
    from trainers.fsdp.worker import FSDPWorker  # noqa: PLC0415
    from trainers.process_group import free_port  # noqa: PLC0415

    config = policy_config(str(checkpoint), PPOLoss(), OptimizerConfig(learning_rate=1e-2, weight_decay=0.1),
                           frozen=frozen, ops_backend="torch", micro_batch_tokens=24)
    return FSDPWorker(0, 1, "127.0.0.1", free_port(), config)


def _assert_same_tensors(got: Path, want: Path, name: str) -> None:
    from safetensors.torch import load_file  # noqa: PLC0415

    a, b = load_file(got / name), load_file(want / name)
    assert a.keys() == b.keys(), (name, a.keys() ^ b.keys())
    for key, tensor in b.items():
        assert a[key].dtype == tensor.dtype and torch.equal(a[key], tensor), (name, key)


@pytest.mark.parametrize("saved_after", [0, 2])
def test_fsdp_resume_is_exact_when_a_trained_parameter_had_no_gradient(tmp_path, saved_after):
    """Four steps in one run against the same run saving after `saved_after` steps, and against a new rank loading
    that checkpoint and taking the rest: the same metrics, and bit-equal weights and AdamW state at the end, where the
    indexer (no gradient) has none. Saved after 0 steps (a policy during a critic warm-up) no parameter has state.
    Before, the load refused ("Missing optimizer state"), and a save before any step gave every parameter the state
    of a step at lr 0, in the checkpoint and in the run that saved."""
    from tests.hf_reference import TINY  # noqa: PLC0415
    from tests.test_deepspeed_conformance import _step  # noqa: PLC0415
    from tests.test_rank_step import _checkpoint  # noqa: PLC0415

    checkpoint, steps = _checkpoint(tmp_path, "tiny", TINY["vocab_size"]), 4
    workers = {run: _fsdp_worker(checkpoint) for run in ("whole", "saver", "resumed")}
    try:
        whole, saver, resumed = workers.values()
        metrics = [_step(whole, step) for step in range(steps)]
        whole.save_checkpoint(str(tmp_path / "whole"))
        assert [_step(saver, step) for step in range(saved_after)] == metrics[:saved_after]
        saver.save_checkpoint(str(tmp_path / "saved"))
        resumed.load_checkpoint(str(tmp_path / "saved"))
        for run in ("saver", "resumed"):
            assert [_step(workers[run], step) for step in range(saved_after, steps)] == metrics[saved_after:], run
            workers[run].save_checkpoint(str(tmp_path / run))
    finally:
        for worker in workers.values():
            worker.shutdown()
    for run in ("saver", "resumed"):
        for name in ("model.safetensors", "optimizer.safetensors"):
            _assert_same_tensors(tmp_path / run, tmp_path / "whole", name)
    from safetensors.torch import load_file  # noqa: PLC0415

    assert not any(".indexer." in key for key in load_file(tmp_path / "whole" / "optimizer.safetensors"))


def test_fsdp_resume_refuses_a_checkpoint_that_froze_a_parameter_this_run_trains(tmp_path):
    """Without optimizer state a parameter starts fresh, but only one the checkpoint's optimizer held: one it froze
    is a changed run, refused with one line naming it."""
    from tests.hf_reference import TINY  # noqa: PLC0415
    from tests.test_rank_step import _checkpoint  # noqa: PLC0415

    checkpoint = _checkpoint(tmp_path, "tiny", TINY["vocab_size"])
    frozen, trains = _fsdp_worker(checkpoint, frozen=(".indexer.",)), _fsdp_worker(checkpoint)
    try:
        frozen.save_checkpoint(str(tmp_path / "saved"))
        with pytest.raises(ValueError, match=r"optimizer.json lists no model\.layers\.0\.self_attn\.indexer\."):
            trains.load_checkpoint(str(tmp_path / "saved"))
    finally:
        frozen.shutdown()
        trains.shutdown()


def test_deepspeed_resumes_from_fsdp2_checkpoints_without_state_for_a_parameter(tmp_path):
    """A ZeRO-1 rank loading FSDP2 checkpoints that hold no AdamW state for the indexer (no gradient yet), saved
    before any step and after two, starts its moments at zero, as AdamW starts a parameter, at the checkpoint's step
    count, and trains on. Before, a KeyError. One rank for both: DeepSpeed keeps the first one's process group."""
    pytest.importorskip("deepspeed")
    from safetensors.torch import load_file  # noqa: PLC0415

    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from tests.hf_reference import TINY  # noqa: PLC0415
    from tests.test_deepspeed_conformance import _step  # noqa: PLC0415
    from tests.test_rank_step import _checkpoint  # noqa: PLC0415
    from trainers.base import OptimizerConfig, policy_config  # noqa: PLC0415
    from trainers.deepspeed.worker import DeepSpeedWorker  # noqa: PLC0415
    from trainers.process_group import free_port  # noqa: PLC0415

    checkpoint = _checkpoint(tmp_path, "tiny", TINY["vocab_size"])
    fsdp = _fsdp_worker(checkpoint)
    try:
        fsdp.save_checkpoint(str(tmp_path / "fsdp0"))
        for step in range(2):
            _step(fsdp, step)
        fsdp.save_checkpoint(str(tmp_path / "fsdp2"))
    finally:
        fsdp.shutdown()
    config = policy_config(str(checkpoint), PPOLoss(), OptimizerConfig(learning_rate=1e-2, weight_decay=0.1),
                           ops_backend="torch", micro_batch_tokens=24, backend_options={"zero_stage": 1})
    zero = DeepSpeedWorker(0, 1, "127.0.0.1", free_port(), config)
    try:
        for step in (0, 2):
            zero.load_checkpoint(str(tmp_path / f"fsdp{step}"))
            zero.save_checkpoint(str(tmp_path / f"zero{step}"))
            state = load_file(tmp_path / f"zero{step}" / "optimizer.safetensors")
            moments = [key for key in state if ".indexer." in key and "/exp_avg" in key]
            assert moments and not any(state[key].any() for key in moments)
            assert {float(v) for key, v in state.items() if key.endswith("/step")} == {float(step)}
            assert math.isfinite(_step(zero, step)["loss"])
    finally:
        zero.shutdown()


def test_a_save_writes_in_a_temporary_directory_named_with_its_pid(manager):
    """A checkpoint is written in `.step_N.tmp-PID-RANDOM`, as an export's (durable.make_temp_dir): a writer that
    finds it beside its output can tell whether the process that made it still runs. It was `.step_N.tmp-RANDOM`."""
    import os
    import re

    seen = []

    def write(tmp: Path) -> None:
        seen.append(tmp.name)
        _write(tmp)

    manager.save(4, write, {})
    assert re.fullmatch(rf"\.step_000004\.tmp-{os.getpid()}-\w+", seen[0]), seen
