"""Writers of one output directory (`slime-dsa export`, tools/convert_hf_to_megatron.py and convert_megatron_to_hf.py,
`slime-dsa sft` and `indexer-warmup`, from their start):
a second writer of the same directory fails at once in one line naming it and the first writer's pid (its lock,
slime_dsa/run_lock.OutputLock, beside the directory); the next writer after a killed one removes what that one left
beside the directory (slime_dsa/durable.remove_leftovers), and only that."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from slime_dsa.cli import main
from tests.test_checkpoints import HOW

ROOT = Path(__file__).resolve().parents[1]
ASSET = ROOT / "recipes" / "assets" / "quickstart-sft"
TOOL = ROOT / "tools" / "convert_hf_to_megatron.py"

# A writer of sys.argv[2] ("export" or "conversion" of ASSET) that stops at its first weight file, says so and sleeps.
PAUSED = """
import importlib.util, sys, time

what, out, asset, tool_path = sys.argv[1:]

def pause(*args, **kwargs):
    print("writing", flush=True)
    time.sleep(120)

if what == "export":
    import slime_dsa.checkpoint.hf_format as hf_format
    from slime_dsa.cli import main
    hf_format.save_file = pause
    main(["export", asset, "--out", out])
else:
    spec = importlib.util.spec_from_file_location("tool", tool_path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.save_file = pause
    tool.main([asset, out])
"""


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("convert_hf_to_megatron", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _paused_writer(what: str, out: Path) -> subprocess.Popen:
    """A process writing `out` (an export or a conversion), returned once it is writing; kill it when done."""
    proc = subprocess.Popen([sys.executable, "-c", PAUSED, what, str(out), str(ASSET), str(TOOL)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    return proc


@pytest.mark.parametrize("first", ["export", "conversion"])
def test_a_second_writer_of_an_output_fails_at_once_naming_it_and_the_pid(tmp_path, capsys, first):
    """An export or a conversion writing OUT: a second export into OUT, and a conversion, exit 2 with one line naming
    OUT and the first one's pid, and OUT is left to the first. Before, nothing guarded it: both wrote, and the last
    rename won."""
    out = tmp_path / "out"
    holder = _paused_writer(first, out)
    try:
        assert main(["export", str(ASSET), "--out", str(out)]) == 2
        assert _tool().main([str(ASSET), str(out)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 2 and "Traceback" not in lines
        for line in lines:
            assert f"{out} is being written by another process (pid {holder.pid})" in line, line
        assert lines[0].startswith("slime-dsa: error: --out ") and lines[1].startswith("error: ")
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_the_leftovers_of_gone_writers_are_removed(tmp_path):
    """Temporary directories and set-aside copies whose pid is gone are removed; a live process's, an older version's
    name without a pid, and another output's are left."""
    from slime_dsa.durable import make_temp_dir, remove_leftovers

    out = tmp_path / "out"
    out.mkdir()
    dead, live = _dead_pid(), os.getppid()
    gone = [tmp_path / f".out.tmp-{dead}-abc", tmp_path / f".out.old-{dead}"]
    kept = [tmp_path / f".out.tmp-{live}-abc", tmp_path / f".out.old-{live}", tmp_path / ".out.tmp-x8k2l1ab",
            tmp_path / f".outer.tmp-{dead}-abc", make_temp_dir(out)]
    for d in gone + kept[:-1]:
        d.mkdir()
        (d / "model.safetensors").write_bytes(bytes(64))
    assert kept[-1].name.startswith(f".out.tmp-{os.getpid()}-")
    removed, restored = remove_leftovers(out)
    assert sorted(removed) == sorted(gone) and restored is None
    assert sorted(tmp_path.iterdir()) == sorted([out, *kept])


def test_a_missing_output_gets_its_set_aside_copy_back(tmp_path):
    """Killed between publish_over's two renames: OUT missing, its old contents whole at .OUT.old-PID. The next writer
    renames that back (so the user's files there are carried into the new output) and removes the rest."""
    from slime_dsa.durable import remove_leftovers

    dead = _dead_pid()
    aside, tmp = tmp_path / f".out.old-{dead}", tmp_path / f".out.tmp-{dead}-abc"
    for d in (aside, tmp):
        d.mkdir()
    (aside / "README.md").write_text("mine")
    assert remove_leftovers(tmp_path / "out") == ([tmp], aside)
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (tmp_path / "out" / "README.md").read_text() == "mine"


def test_a_conversion_after_a_killed_one_removes_its_leftovers_in_one_line(tmp_path, caplog):
    """A conversion killed part way leaves its temporary directory and lock beside OUT; the next conversion into OUT
    removes them and says so in one line, leaving a live writer's temporary directory. Before, each killed conversion
    left a hidden directory of shards that nothing removed."""
    import tests.test_convert_tools as convert_tools

    out = tmp_path / "out"
    convert_tools._kill("convert_hf_to_megatron.py", "first copy", [str(ASSET), str(out)])
    left = sorted(p.name for p in tmp_path.glob(".out.tmp-*"))
    assert len(left) == 1
    live = tmp_path / f".out.tmp-{os.getppid()}-abc"
    live.mkdir()
    with caplog.at_level(logging.INFO, logger="slime_dsa.run_lock"):
        assert _tool().main([str(ASSET), str(out)]) == 0
    lines = [r.getMessage() for r in caplog.records if "killed" in r.getMessage()]
    assert lines == [f"{out}: removed {left[0]} (left by a writer that was killed)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "out"]


@pytest.mark.slow  # two exports and a killed one in a subprocess: ~10 s
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("when", ["before", "after"])
def test_an_export_after_one_killed_mid_swap_removes_its_leftovers_and_keeps_the_users_files(tmp_path, caplog, how,
                                                                                              when):
    """An export over an existing one killed just before the rename of its new directory or just after (where the
    swap falls back to renames: OUT missing and the old one set aside, or the old one set aside, not yet deleted):
    the next export puts back or removes what it left, carries the user's README over, and leaves nothing beside OUT.
    Before, the set-aside copy and the temporary directory, a model's size each, stayed there for good."""
    from tests.test_checkpoint_durability import EXPORT_KILLED, _export_old

    out = tmp_path / "export"
    _export_old(out)
    done = subprocess.run([sys.executable, "-c", EXPORT_KILLED, str(ASSET), str(out), how, when], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 9, done.stderr
    assert list(tmp_path.glob(".export.*"))
    with caplog.at_level(logging.INFO, logger="slime_dsa.run_lock"):
        assert main(["export", str(ASSET), "--out", str(out)]) == 0
    assert [r.getMessage() for r in caplog.records if "killed" in r.getMessage()] != []
    assert [p.name for p in tmp_path.iterdir()] == ["export"] and (out / "README.md").read_text() == "mine"


# A run of sys.argv[1] (sft or indexer-warmup) on the recipe sys.argv[2] that stops at its training, says so and sleeps.
PAUSED_RUN = """
import sys, time

command, recipe = sys.argv[1:]

def pause(*args, **kwargs):
    print("training", flush=True)
    time.sleep(120)

import slime_dsa.indexer.warmup, slime_dsa.sft
from slime_dsa.cli import main
slime_dsa.sft.sft_step = slime_dsa.indexer.warmup.train_indexers = pause
main([command, recipe])
"""


def _job_recipe(tmp_path: Path, command: str, run_dir: Path, output: Path | None) -> Path:
    """A small sft (tiny preset) or indexer-warmup (the quickstart model) recipe in run_dir writing `output` (None: its
    default in run_dir)."""
    import yaml

    data = {"tasks": [{"kind": "arithmetic", "train_size": 40, "eval_size": 8, "task_args": {"max_digits": 1}}]}
    logging_ = {"run_dir": str(run_dir), "wandb_mode": "disabled"}
    if command == "sft":
        recipe = {"model": {"preset": "tiny"}, "data": {**data, "max_prompt_length": 32},
                  "rollout": {"max_response_length": 8}, "trainer": {"num_steps": 1, "micro_batch_tokens": 2048},
                  "sft": {"batch_size": 4, "eval_every": 0, "output_dir": str(output) if output else None},
                  "logging": logging_}
    else:
        recipe = {"model": {"path": str(ASSET)}, "data": data,
                  "indexer_warmup": {"corpus": "tasks", "seq_len": 32, "index_topk": 8, "batch_size": 2,
                                     "num_steps": 1, "eval_sequences": 1, "eval_every": 0,
                                     "output_dir": str(output) if output else None},
                  "logging": logging_}
    path = tmp_path / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _no_training(monkeypatch) -> None:
    """In this process, sft and indexer-warmup fail at their first step (a second writer must not get that far)."""
    import slime_dsa.indexer.warmup
    import slime_dsa.sft

    def trained(*args, **kwargs):
        raise AssertionError("the second writer trained")

    monkeypatch.setattr(slime_dsa.sft, "sft_step", trained)
    monkeypatch.setattr(slime_dsa.indexer.warmup, "train_indexers", trained)


KEYS = {"sft": "sft.output_dir", "indexer-warmup": "indexer_warmup.output_dir"}
DEFAULTS = {"sft": "sft_model", "indexer-warmup": "dsa_model"}


@pytest.mark.parametrize("command", ["sft", "indexer-warmup"])
@pytest.mark.parametrize("shared", ["set", "the first run's default"])
def test_a_second_sft_or_warm_up_into_the_same_output_fails_at_its_start(tmp_path, capsys, monkeypatch, command,
                                                                          shared):
    """A run of sft (indexer-warmup) training into OUT, set or its default in its run directory: a second run of
    another run directory into OUT exits 2 at its start, before any training, in one line naming the key, OUT and the
    first run's pid, and writes nothing of its run directory but the lock; an export into OUT fails the same way.
    Before, nothing guarded OUT: both trained and wrote it, and the last rename won."""
    first_run = tmp_path / "first"
    out = tmp_path / "out" if shared == "set" else first_run / DEFAULTS[command]
    first = _job_recipe(tmp_path, command, first_run, out if shared == "set" else None)
    holder = subprocess.Popen([sys.executable, "-c", PAUSED_RUN, command, str(first)], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "training"
        _no_training(monkeypatch)
        second = _job_recipe(tmp_path, command, tmp_path / "second", out)
        assert main([command, str(second)]) == 2
        assert main(["export", str(ASSET), "--out", str(out)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 2 and "Traceback" not in lines
        said = f"{out} is being written by another process (pid {holder.pid})"
        assert lines[0] == f"slime-dsa: error: {KEYS[command]} {said}; wait for it to end or write elsewhere"
        assert lines[1].startswith(f"slime-dsa: error: --out {said}")
        assert [p.name for p in (tmp_path / "second").iterdir()] == [".lock"] and not out.exists()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("command", ["sft", "indexer-warmup"])
def test_an_sft_or_warm_up_removes_a_killed_writers_leftovers_at_its_start(tmp_path, monkeypatch, command):
    """What killed writers left beside the output (a temporary directory, a set-aside copy, their pids gone) is
    removed when the run starts, before it trains, in one line of the run's log; nothing but the output is left
    beside it at the end (its lock removed). Before, sft and indexer-warmup took no lock and removed nothing."""
    import slime_dsa.indexer.warmup
    import slime_dsa.sft

    out = tmp_path / "model"
    out.mkdir()
    dead = _dead_pid()
    leftovers = [tmp_path / f".model.tmp-{dead}-abc", tmp_path / f".model.old-{dead}"]
    for d in leftovers:
        d.mkdir()
        (d / "model.safetensors").write_bytes(bytes(64))
    seen = []
    module, name = (slime_dsa.sft, "sft_step") if command == "sft" else (slime_dsa.indexer.warmup, "train_indexers")
    step = getattr(module, name)

    def spy(*args, **kwargs):
        seen.append(sorted(p.name for p in tmp_path.glob(".model.*")))
        return step(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    monkeypatch.setattr(slime_dsa.sft, "greedy_eval", lambda *args, **kwargs: {})
    assert main([command, str(_job_recipe(tmp_path, command, tmp_path / "run", out))]) == 0
    assert seen == [[".model.lock"]]
    log = (tmp_path / "run" / f"{command.replace('-', '_')}.log").read_text()
    assert f"{out}: removed {leftovers[1].name}, {leftovers[0].name} (left by a writer that was killed)" in log
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert (out / "config.json").is_file()


def test_an_older_versions_temporary_directory_is_left_and_named_in_one_warning(tmp_path, caplog):
    """`.OUT.tmp-RANDOM` (no pid: versions before pids in the names, which took no lock) is never removed, even when
    its random part is all digits (it was read as a pid no process has, and removed); the next writer names it in one
    WARNING saying why it is left and what to do. Before, such a directory stayed silently (and an all-digit one was
    removed while its writer could still be writing it)."""
    from slime_dsa.durable import older_leftovers, remove_leftovers

    out = tmp_path / "out"
    older = [tmp_path / ".out.tmp-12345678", tmp_path / ".out.tmp-x8k2l1ab"]  # pid_max is at most 4194304
    for d in older:
        d.mkdir()
        (d / "model.safetensors").write_bytes(bytes(64))
    gone = tmp_path / f".out.tmp-{_dead_pid()}-abcdefgh"  # this version's, its writer gone: removed
    gone.mkdir()
    assert older_leftovers(out) == older
    assert remove_leftovers(out) == ([gone], None)
    with caplog.at_level(logging.INFO, logger="slime_dsa.run_lock"):
        assert main(["export", str(ASSET), "--out", str(out)]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"{out}: left .out.tmp-12345678, .out.tmp-x8k2l1ab beside it: temporary directories of an "
                        "older slime-dsa (no pid in the name), which took no lock and may still be writing; remove "
                        "them by hand once none writes out"]
    assert sorted(tmp_path.iterdir()) == sorted([out, *older])


def test_an_output_dir_that_is_or_holds_the_run_directory_is_refused(tmp_path):
    """sft.output_dir (or indexer_warmup.output_dir) naming the run directory or one above it was accepted: the
    model's publish renamed it over the run directory, its log, metrics and the lock the job held. Refused by recipe
    check in one line; one inside the run directory or beside it passes."""
    import pytest

    from slime_dsa.config import load_recipe
    from slime_dsa.config.errors import RecipeError
    from slime_dsa.config.paths import check_recipe_paths

    run_dir = tmp_path / "runs" / "a"
    for key in ("sft.output_dir", "indexer_warmup.output_dir"):
        for output, what in ((run_dir, "the run directory"),
                             (tmp_path / "runs", "a directory holding the run directory")):
            recipe = load_recipe(None, [f"logging.run_dir={run_dir}", f"{key}={output}"])
            with pytest.raises(RecipeError) as info:
                check_recipe_paths(recipe, trainer_workers=False)
            assert str(info.value) == (f"{key}: {output} is {what} ({run_dir}), which publishing the model there "
                                       "would replace; name a directory inside it or beside it")
        for output in (run_dir / "model", tmp_path / "runs" / "model"):
            check_recipe_paths(load_recipe(None, [f"logging.run_dir={run_dir}", f"{key}={output}"]),
                               trainer_workers=False)
