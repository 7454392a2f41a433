"""Tools that fork-bomb or allocate 10 GB during real agent rollouts: each costs only its own call. Multi-turn
trajectories over 2 embedded engine subprocesses (benchmarks/agent_robustness.py), with a third of the tool calls
running a fork bomb or a 10 GB allocation in the real sandbox; no trajectory is lost and no sandboxed process
outlives its call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_tools import _sandbox_processes

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_fork_bombs_and_10gb_allocations_in_tools_cost_only_their_calls(tmp_path, figures):
    out = tmp_path / "result.json"
    subprocess.run([sys.executable, "benchmarks/agent_robustness.py", "--trajectories", "40", "--fail-share", "0.3",
                    "--faults", "fork_bomb,alloc_10gb", "--json", str(out)],
                   cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True, timeout=900)
    result = json.loads(out.read_text())
    assert result["lost"] == 0 and result["raised"] == 0, result["errors"]
    assert sum(result["status"].values()) == 40
    assert result["injected"].get("fork_bomb", 0) > 0 and result["injected"].get("alloc_10gb", 0) > 0
    assert result["tool_failures"] > 0
    assert not _sandbox_processes(), "a sandboxed process outlived its call"
    figures["tool_fork_bomb_and_10gb"] = {"trajectories": 40, "lost": result["lost"], "injected": result["injected"],
                                          "wall_s": result["wall_s"]}
