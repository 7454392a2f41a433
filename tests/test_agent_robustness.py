"""benchmarks/agent_robustness.py at a tenth of its size: 100 concurrent multi-turn trajectories over 2 engine
subprocesses while 10% of tool calls raise, hang or crash. No trajectory may be lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_hundred_trajectories_survive_failing_tools(tmp_path):
    out = tmp_path / "result.json"
    subprocess.run([sys.executable, "benchmarks/agent_robustness.py", "--trajectories", "100", "--json", str(out)],
                   cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True, timeout=900)
    result = json.loads(out.read_text())
    assert result["lost"] == 0 and result["raised"] == 0, result["errors"]
    assert sum(result["status"].values()) == 100
    assert result["multi_turn"] > 50 and result["tool_failures"] > 0
    assert sum(v for k, v in result["injected"].items() if k != "ok") > 0
    assert len(result["engine_requests"]) == 2 and all(n > 0 for n in result["engine_requests"].values())
