"""Checkpoints and exports survive a crash or a power loss: every file written into the temporary directory, and the
directory itself, is fsynced before the rename that publishes it, and the parent directory after it (real saves: an
FSDP2 rank of one over gloo writing a run checkpoint through the orchestrator's save, and `export`). Before, nothing
was fsynced: after a power loss the rename could be on disk and the files' contents not, a checkpoint that looks
complete but holds zeros."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.test_checkpoints import HOW, KILL_AROUND_RENAME, _fsdp_worker, fail_rename

ASSET = Path(__file__).resolve().parents[1] / "recipes" / "assets" / "quickstart-sft"


@pytest.fixture
def disk_events(monkeypatch) -> list[tuple[str, ...]]:
    """("fsync", path) and ("replace", source, target) in the order they happen, the real calls made (a swap of two
    names, durable.exchange, is a replace of the target by the source)."""
    import slime_dsa.durable as durable

    events: list[tuple[str, ...]] = []
    real_fsync, real_replace, real_exchange = os.fsync, os.replace, durable._renameat2_exchange

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(source, target, **kwargs) -> None:
        events.append(("replace", str(Path(source).resolve()), str(Path(target).resolve())))
        real_replace(source, target, **kwargs)

    def exchange(source, target) -> int:
        error = real_exchange(source, target)
        if error == 0:
            events.append(("replace", str(Path(source).resolve()), str(Path(target).resolve())))
        return error

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(durable, "_renameat2_exchange", exchange)
    return events


def assert_published_durably(events: list[tuple[str, ...]], final: Path) -> None:
    """`final` was renamed into place after all it holds (its files and directories, as the temporary directory named
    them) was fsynced, and its parent directory was fsynced after the rename."""
    final = final.resolve()
    renames = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(final)]
    assert len(renames) == 1, f"{final} was not renamed into place once: {events}"
    at, tmp = renames[0], Path(events[renames[0]][1])
    synced_before = {e[1] for e in events[:at] if e[0] == "fsync"}
    wanted = {str(tmp)} | {str(tmp / p.relative_to(final)) for p in final.rglob("*")}
    assert not wanted - synced_before, f"not fsynced before the rename: {sorted(wanted - synced_before)}"
    assert ("fsync", str(final.parent)) in events[at + 1:], f"{final.parent} not fsynced after the rename"


def test_a_run_checkpoint_is_fsynced_then_renamed_then_its_parent_fsynced(tmp_path, disk_events):
    """The orchestrator's save of a real FSDP2 rank's checkpoint (weights, AdamW state, RNG state in a subdirectory,
    the tokenizer, orchestrator.json)."""
    from slime_dsa.checkpoint.training import CheckpointManager
    from slime_dsa.orchestrator.step import save_checkpoint

    ckpts = CheckpointManager(tmp_path / "checkpoints")
    worker = _fsdp_worker(ASSET)
    try:
        save_checkpoint(ckpts, 3, worker, {"next": 3}, ASSET)
    finally:
        worker.shutdown()
    final = ckpts.path_for(3)
    assert {"model.safetensors", "optimizer.safetensors", "tokenizer.json", "orchestrator.json"} <= {
        p.name for p in final.iterdir()}
    assert_published_durably(disk_events, final)
    assert ckpts.latest() == final


@pytest.mark.parametrize("out_exists", [False, True])
def test_an_export_is_fsynced_with_its_tokenizer_then_renamed(tmp_path, disk_events, out_exists):
    """`export` into a new directory: the weights, config and tokenizer fsynced, then the one rename. Before, the
    tokenizer was copied in after the rename (an export without one after a crash there) and nothing was fsynced.
    Into an existing directory the same, the user's README carried into the temporary directory and kept."""
    from slime_dsa.checkpoint.training import export_checkpoint

    out = tmp_path / "export"
    if out_exists:
        out.mkdir()
        (out / "README.md").write_text("mine")
    export_checkpoint(ASSET, out)
    written = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    assert {p.name for p in out.iterdir()} == set(written) | ({"README.md"} if out_exists else set())
    assert_published_durably(disk_events, out)


# An export over an existing one, killed by os._exit in a subprocess just before or just after the first os.replace
# that renames something written into its temporary directory into place (no except or finally runs). The new
# weights are the old ones plus 1.
EXPORT_KILLED = KILL_AROUND_RENAME + """
import sys
from pathlib import Path
from slime_dsa.checkpoint.hf_format import load_model, read_state_dict, save_pretrained

asset, out, how, when = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
new = {name: tensor + 1 for name, tensor in read_state_dict(out).items()}
kill_around_rename(".export.tmp-", how, when)
save_pretrained(load_model(asset), out, max_shard_bytes=1 << 20, state_dict=new)
"""


def _export_old(out: Path) -> dict:
    """ASSET's model saved into `out` in shards, with a README of the user's beside it: the old weights."""
    from slime_dsa.checkpoint.hf_format import load_model, read_state_dict, save_pretrained

    save_pretrained(load_model(ASSET), out, max_shard_bytes=1 << 20)
    (out / "README.md").write_text("mine")
    return read_state_dict(out)


def _same(state: dict, expected: dict) -> bool:
    import torch

    return state.keys() == expected.keys() and all(torch.equal(state[k], v) for k, v in expected.items())


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("when", ["before", "after"])
def test_an_export_over_an_existing_one_killed_mid_swap_loses_neither_and_never_mixes(tmp_path, how, when):
    """Killed around the rename that publishes it: the directory loads the whole old weight set or the whole new one
    (the user's README kept), or the loader refuses it in one line naming where the whole old set is. Before, the old
    weights were unlinked and the new files renamed in one by one: a kill there left a directory with some of the new
    files and the old weights gone."""
    import subprocess
    import sys

    from slime_dsa.checkpoint.hf_format import load_model, read_state_dict

    out = tmp_path / "export"
    old = _export_old(out)
    new = {name: tensor + 1 for name, tensor in old.items()}
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", EXPORT_KILLED, str(ASSET), str(out), how, when], cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 9, done.stderr
    try:
        load_model(out)
    except (OSError, ValueError) as e:
        message = str(e)
        assert "\n" not in message and ".export.old-" in message, message
        aside = next(tmp_path.glob(".export.old-*"))
        assert str(aside) in message and _same(read_state_dict(aside), old)
        assert (aside / "README.md").read_text() == "mine"
        return
    assert _same(read_state_dict(out), old) or _same(read_state_dict(out), new)
    assert (out / "README.md").read_text() == "mine"


def test_an_export_over_an_existing_one_swaps_with_it_and_is_never_missing(tmp_path, monkeypatch):
    """On Linux the new directory and the old swap names in one step (durable.exchange): the directory is never
    renamed away, and holds the new weights and the user's README after, with nothing left beside it. Before, the old
    one was renamed aside first, and until the new one was renamed in the directory did not exist (a server that
    loaded it then found nothing)."""
    from slime_dsa.checkpoint.hf_format import load_model, read_state_dict, save_pretrained

    out = tmp_path / "export"
    new = {name: tensor + 1 for name, tensor in _export_old(out).items()}
    moved, real_replace = [], os.replace

    def replace(source, target, **kwargs):
        moved.append(Path(source))
        real_replace(source, target, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    save_pretrained(load_model(ASSET), out, max_shard_bytes=1 << 20, state_dict=new)
    assert out not in moved
    assert _same(read_state_dict(out), new) and (out / "README.md").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


@pytest.mark.parametrize("how", HOW)
def test_an_export_over_an_existing_one_whose_rename_fails_keeps_the_old_one(tmp_path, monkeypatch, how):
    """The rename that publishes an export over an existing one fails (EIO): the error reaches the caller and the
    directory holds its old weights and the user's README, with nothing left beside it. Before, the old weights had
    been unlinked first."""
    from slime_dsa.checkpoint.hf_format import load_model, read_state_dict, save_pretrained

    out = tmp_path / "export"
    old = _export_old(out)
    fail_rename(monkeypatch, ".export.tmp-", how)
    with pytest.raises(OSError, match="Input/output"):
        save_pretrained(load_model(ASSET, dtype="bfloat16"), out)
    assert _same(read_state_dict(out), old) and (out / "README.md").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


@pytest.fixture(scope="module")
def written_checkpoint(tmp_path_factory) -> Path:
    """A real run checkpoint: an FSDP2 rank's files, the tokenizer and orchestrator.json, through the orchestrator."""
    from slime_dsa.checkpoint.training import CheckpointManager
    from slime_dsa.orchestrator.step import save_checkpoint

    ckpts = CheckpointManager(tmp_path_factory.mktemp("written") / "checkpoints")
    worker = _fsdp_worker(ASSET)
    try:
        save_checkpoint(ckpts, 3, worker, {"next": 3}, ASSET)
    finally:
        worker.shutdown()
    return ckpts.path_for(3)


def _zero_tensor_data(path: Path) -> None:
    """Zeros over a safetensors file's tensor data, its header and size kept: what a power loss leaves when the file's
    size reached the disk and its data did not."""
    data = path.read_bytes()
    start = 8 + int.from_bytes(data[:8], "little")
    assert len(data) > start, f"{path} holds no tensor data"
    path.write_bytes(data[:start] + bytes(len(data) - start))


def _edit_step(path: Path) -> None:
    text = path.read_text()
    assert '"step": 0' in text
    path.write_text(text.replace('"step": 0', '"step": 7', 1))


SAME_SIZE_DAMAGE = [
    ("model.safetensors", _zero_tensor_data),
    ("rng_rank0.safetensors", _zero_tensor_data),
    ("trainer.json", _edit_step),
]


@pytest.mark.parametrize("name, damage", SAME_SIZE_DAMAGE, ids=[name for name, _ in SAME_SIZE_DAMAGE])
def test_a_file_changed_at_its_written_size_is_refused_in_one_line_naming_it(tmp_path, caplog, written_checkpoint,
                                                                               name, damage):
    """A file of the size written whose contents are not what was written (zeros over a safetensors file's tensors, a
    trainer.json edited) is refused with one line naming it, and a resume falls back past it. Before, only sizes,
    JSON syntax and safetensors headers were checked: the checkpoint passed as intact and a resume loaded the zeros."""
    import logging
    import shutil

    from slime_dsa.checkpoint.training import CheckpointManager

    ckpts = CheckpointManager(tmp_path / "checkpoints")
    shutil.copytree(written_checkpoint, ckpts.path_for(3))
    assert ckpts.latest() == ckpts.path_for(3)
    damage(ckpts.path_for(3) / name)
    with caplog.at_level(logging.WARNING, logger="slime_dsa.checkpoint.training"):
        assert ckpts.latest() is None
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"checkpoint {ckpts.path_for(3)} skipped: {name} does not hold what was written" in warning, warning
    assert "\n" not in warning


def test_only_files_up_to_the_checksum_limit_are_hashed(tmp_path, monkeypatch):
    """Hashing a GLM-5-sized checkpoint's weights and optimizer state would take minutes on every save and resume:
    files above CHECKSUM_MAX_BYTES get their size checked, not a checksum."""
    import json

    import slime_dsa.checkpoint.validate as validate
    from slime_dsa.checkpoint.training import CheckpointManager

    def write(tmp: Path) -> None:
        (tmp / "trainer.json").write_text(json.dumps({"step": 1}))
        (tmp / "model.safetensors").write_bytes(bytes(4096))

    monkeypatch.setattr(validate, "CHECKSUM_MAX_BYTES", 1024)
    final = CheckpointManager(tmp_path / "checkpoints").save(1, write, {})
    state = json.loads((final / "orchestrator.json").read_text())
    assert set(state["files"]) == {"trainer.json", "model.safetensors"} and set(state["sha256"]) == {"trainer.json"}


SFT = {"model": {"preset": "tiny"}, "trainer": {"num_steps": 2, "micro_batch_tokens": 2048},
       "sft": {"batch_size": 4, "eval_every": 0, "eval_prompts": 4}}
INDEXER_WARMUP = {"model": {"path": str(ASSET)}, "data": {"tasks": [{"kind": "arithmetic", "eval_size": 8}]},
                  "indexer_warmup": {"corpus": "tasks", "seq_len": 64, "index_topk": 16, "batch_size": 2,
                                     "num_steps": 2, "eval_sequences": 2, "eval_every": 0}}


JOBS = [("sft", SFT, "sft_summary.json"), ("indexer-warmup", INDEXER_WARMUP, "indexer_warmup_summary.json")]


@pytest.mark.parametrize("command, recipe, summary", JOBS, ids=[command for command, _, _ in JOBS])
def test_sft_and_indexer_warmup_publish_the_model_with_its_tokenizer_and_summary(tmp_path, disk_events, command,
                                                                                   recipe, summary):
    """The model directory sft and indexer-warmup write: weights, tokenizer and summary fsynced, then one rename.
    Before, the tokenizer and the summary were written into it after the rename, not fsynced (a model without them
    after a crash there), and the summary rewritten in place in an existing output directory."""
    import yaml

    from slime_dsa.cli import main

    out = tmp_path / "model"
    section = "sft" if command == "sft" else "indexer_warmup"
    data = {"tasks": [{"kind": "arithmetic", "eval_size": 4, "train_size": 40, "task_args": {"max_digits": 1}}],
            "apply_chat_template": True, "max_prompt_length": 64}
    full = {**recipe, "data": data, section: {**recipe[section], "output_dir": str(out)},
            "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled"}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(full))
    assert main([command, str(tmp_path / "recipe.yaml")]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", summary} <= {p.name for p in out.iterdir()}
    assert_published_durably(disk_events, out)


def test_metrics_reach_the_disk_before_the_checkpoint_that_covers_their_steps(tmp_path, disk_events):
    """A step's tail (orchestrator/step.after_step) logging step 2 and checkpointing it: metrics.jsonl is fsynced
    before the checkpoint's rename. Before, it never was: after a power loss the checkpoint of step 2 could be on disk
    and the records of steps 1-2 not, and a resume from it logs only the steps after it."""
    import asyncio
    from types import SimpleNamespace

    from slime_dsa.checkpoint.training import CheckpointManager
    from slime_dsa.config.schema import RecipeConfig
    from slime_dsa.logging.metrics import MetricsLogger
    from slime_dsa.orchestrator.step import after_step

    recipe = RecipeConfig.model_validate({"logging": {"log_every": 1}, "checkpoint": {"save_every": 2},
                                          "trainer": {"num_steps": 10}})
    metrics = MetricsLogger(tmp_path / "run", "p", None, "disabled")
    worker = _fsdp_worker(ASSET)
    run = SimpleNamespace(recipe=recipe, engine_stats=None, driver_gc=None, metrics_log=metrics,
                          manager=SimpleNamespace(state_dict=lambda: {"next": 2}), progress=SimpleNamespace(saved=0),
                          ckpts=CheckpointManager(tmp_path / "run" / "checkpoints"), trainers=worker, model_dir=ASSET)
    try:
        for step in range(2):
            asyncio.run(after_step(run, step, {"train/loss": 0.1}))
    finally:
        worker.shutdown()
        metrics.close()
    final = run.ckpts.path_for(2)
    assert_published_durably(disk_events, final)
    rename = next(i for i, e in enumerate(disk_events) if e[0] == "replace" and e[2] == str(final.resolve()))
    assert ("fsync", str((tmp_path / "run" / "metrics.jsonl").resolve())) in disk_events[:rename]
