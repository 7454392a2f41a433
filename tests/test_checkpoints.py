"""Run checkpoints: a damaged newest checkpoint is skipped with one WARNING for the newest intact one, and the
temporary directories a killed save left behind are removed at the next start."""

from __future__ import annotations

import json
import logging
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
