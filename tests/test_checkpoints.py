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
