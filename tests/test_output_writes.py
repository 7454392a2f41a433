"""Writers of one output directory (`slime-dsa export`, tools/convert_hf_to_megatron.py and convert_megatron_to_hf.py):
a second writer of the same directory fails at once in one line naming it and the first writer's pid (its lock,
slime_dsa/run_lock.OutputLock, beside the directory)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from slime_dsa.cli import main

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
