"""The Triton kernels on CPU, through Triton's interpreter, against the torch reference (tests/interpret_checks.py).

The interpreter is chosen when a kernel is defined, so the checks run in a child process that sets
TRITON_INTERPRET=1 before importing them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~6 s of CPU, most of it importing torch and triton in the child process
def test_triton_kernels_match_reference_in_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "tests.interpret_checks"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
