"""tools/convert_hf_to_megatron.py and convert_megatron_to_hf.py write their output into a temporary directory beside
it and publish it with one rename (slime_dsa/durable.py): a conversion killed part way leaves no output that looks
complete, and one over a previous output leaves that one whole; a finished one over it keeps the user's files and
none of the old shards. The writing path runs without megatron-core (trainers/megatron/convert.py is pure torch);
tests/test_megatron.py checks the conversion itself where megatron-core is installed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
ASSET = ROOT / "recipes" / "assets" / "quickstart-sft"
if importlib.util.find_spec("trainers.megatron.convert") is None:
    pytest.skip("trainers/megatron/convert.py is not importable", allow_module_level=True)

# Runs a tool's main(argv) and kills it with os._exit (no except or finally runs) at `kill_at`: the second
# save_file (one shard written, more to come) or the first shutil.copy (the weights written, config.json not).
TOOL_KILLED = """
import importlib.util, os, shutil, sys

script, kill_at, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
spec = importlib.util.spec_from_file_location("tool", script)
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)
real_save_file, saved = tool.save_file, []

def save_file(*args, **kwargs):
    saved.append(1)
    if kill_at == "second save_file" and len(saved) == 2:
        os._exit(9)
    real_save_file(*args, **kwargs)

def copy(*args, **kwargs):
    os._exit(9)

tool.save_file = save_file
if kill_at == "first copy":
    shutil.copy = copy
tool.main(argv)
"""


def _tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


@pytest.fixture(scope="module")
def megatron_dir(tmp_path_factory) -> Path:
    """ASSET converted to Megatron shards, expert-parallel 2."""
    out = tmp_path_factory.mktemp("converted") / "megatron"
    assert _tool("convert_hf_to_megatron").main([str(ASSET), str(out), "--expert-parallel", "2"]) == 0
    return out


def _kill(script: str, kill_at: str, args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-c", TOOL_KILLED, str(ROOT / "tools" / script), kill_at, *args],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 9, done.stderr


def _contents(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("script", "kill_at"), [("convert_hf_to_megatron.py", "second save_file"),
                                                  ("convert_hf_to_megatron.py", "first copy"),
                                                  ("convert_megatron_to_hf.py", "first copy")])
def test_a_killed_conversion_leaves_no_output(tmp_path, megatron_dir, script, kill_at):
    """Killed after writing part of its output: OUT does not exist (its temporary directory is a hidden sibling).
    Before, OUT held the shards or weights written so far, without config.json or megatron.json."""
    src = ASSET if script == "convert_hf_to_megatron.py" else megatron_dir
    out = tmp_path / "out"
    _kill(script, kill_at, [str(src), str(out)] + (["--expert-parallel", "2"] if src == ASSET else []))
    assert not out.exists()
    # beside it only its temporary directory and its lock (run_lock.OutputLock), both for the next writer to remove
    assert all(p.name.startswith(".out.tmp-") or p.name == ".out.lock" for p in tmp_path.iterdir())


def test_a_killed_conversion_over_a_previous_output_leaves_it_whole(tmp_path, megatron_dir):
    """Megatron shards of expert-parallel 2 converted again with 1, killed once its shards are written: OUT holds the
    previous output byte for byte. Before, its mp_rank_00_000 held the new layout's shard and megatron.json the old
    layout's sizes."""
    out = tmp_path / "out"
    assert _tool("convert_hf_to_megatron").main([str(ASSET), str(out), "--expert-parallel", "2"]) == 0
    (out / "README.md").write_text("mine")
    before = _contents(out)
    _kill("convert_hf_to_megatron.py", "first copy", [str(ASSET), str(out)])
    assert _contents(out) == before


def test_a_killed_hf_conversion_over_a_previous_output_leaves_it_whole(tmp_path, megatron_dir):
    """An HF directory written again from Megatron shards, killed once its weights are written: OUT holds the previous
    files byte for byte. Before, its model.safetensors was the new one and its config.json the old."""
    out = tmp_path / "out"
    out.mkdir()
    save_file({"old": torch.zeros(4)}, out / "model.safetensors")
    (out / "config.json").write_text("{}")
    before = _contents(out)
    _kill("convert_megatron_to_hf.py", "first copy", [str(megatron_dir), str(out)])
    assert _contents(out) == before


def test_a_conversion_over_a_previous_output_replaces_its_shards_and_keeps_the_users_files(tmp_path):
    """Expert-parallel 1 over a previous expert-parallel 2 output: only the new layout's shard directory is there, the
    user's README kept. Before, the old layout's mp_rank_00_001 stayed beside the new shard."""
    tool = _tool("convert_hf_to_megatron")
    out = tmp_path / "out"
    assert tool.main([str(ASSET), str(out), "--expert-parallel", "2"]) == 0
    (out / "README.md").write_text("mine")
    assert tool.main([str(ASSET), str(out)]) == 0
    assert sorted(p.name for p in out.glob("mp_rank_*")) == ["mp_rank_00_000"]
    assert json.loads((out / "megatron.json").read_text()) == {"tensor_parallel": 1, "expert_parallel": 1}
    assert (out / "README.md").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("script", ["convert_hf_to_megatron.py", "convert_megatron_to_hf.py"])
def test_a_conversion_is_readable_by_other_users_as_the_umask_allows(tmp_path, megatron_dir, script):
    """safetensors writes its files 0600: every shard of a conversion was unreadable to any other user (a trainer's
    or a serving engine's). Every directory and file of the output now gets the modes a plain mkdir and open would."""
    import stat

    src = ASSET if script == "convert_hf_to_megatron.py" else megatron_dir
    out = tmp_path / "out"
    umask = os.umask(0o022)
    try:
        assert _tool(script.removesuffix(".py")).main([str(src), str(out)]) == 0
    finally:
        os.umask(umask)
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in [out, *out.rglob("*")]}
    assert any(name.endswith(".safetensors") for name in modes)
    assert modes == {name: 0o755 if (tmp_path / name).is_dir() else 0o644 for name in modes}
