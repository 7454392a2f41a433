"""benchmarks/paged_indexer_variants.py's smoke run on CPU through Triton's interpreter: every scoring and select
variant picks exactly what the current paged indexer picks (small-integer inputs, many ties), which itself equals the
torch reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~55 s of CPU: the interpreter runs every variant at two tiny batches
def test_every_variant_selects_what_the_current_kernels_select(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "variants.json"
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    result = subprocess.run([sys.executable, "benchmarks/paged_indexer_variants.py", "--smoke", "--out", str(out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["batch"] for r in rows} == {1, 3}
    assert len({r["variant"] for r in rows}) >= 15
    assert all(r["exact"] for r in rows), [r["variant"] for r in rows if not r["exact"]]
