"""README.md holds the install and test commands, and `.ci/run` extracts them by their markers."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CI_RUN = ROOT / ".ci" / "run"


def print_commands(root: Path) -> subprocess.CompletedProcess[str]:
    """Run `.ci/run --print-commands` in `root` (which must hold .ci/run and README.md)."""
    return subprocess.run(
        ["bash", str(root / ".ci" / "run"), "--print-commands"], capture_output=True, text=True, timeout=60
    )


def parse(output: str) -> dict[str, str]:
    """Split `[install]\\n...\\n[test]\\n...` into {"install": ..., "test": ...}."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in output.splitlines():
        if line in ("[install]", "[test]"):
            current = sections.setdefault(line.strip("[]"), [])
        elif current is not None:
            current.append(line)
    return {name: "\n".join(lines) for name, lines in sections.items()}


def test_ci_run_is_executable_bash() -> None:
    assert os.access(CI_RUN, os.X_OK)
    assert "set -euo pipefail" in CI_RUN.read_text()


def test_readme_has_install_and_test_commands() -> None:
    result = print_commands(ROOT)
    assert result.returncode == 0, result.stderr
    commands = parse(result.stdout)
    assert commands.keys() == {"install", "test"}
    assert "pip install" in commands["install"] and ".[test]" in commands["install"]
    assert "pytest" in commands["test"]


def _fake_repo(tmp_path: Path, readme: str) -> Path:
    """A directory with a copy of .ci/run and the given README.md."""
    (tmp_path / ".ci").mkdir(parents=True)
    shutil.copy(CI_RUN, tmp_path / ".ci" / "run")
    (tmp_path / "README.md").write_text(readme)
    return tmp_path


def test_extraction_rule(tmp_path: Path) -> None:
    readme = (
        "# x\n\n```bash\necho decoy\n```\n\n<!-- install -->\n```bash\npip install -e '.[test]'\n```\n\n"
        "text\n\n  <!-- test -->  \n\n```bash\npytest -q -x\n```\n"
    )
    result = print_commands(_fake_repo(tmp_path, readme))
    assert result.returncode == 0, result.stderr
    assert parse(result.stdout) == {"install": "pip install -e '.[test]'", "test": "pytest -q -x"}


BAD_READMES = {
    "missing_test_marker": ("<!-- install -->\n```bash\npip install .\n```\n```bash\npytest\n```\n", "<!-- test -->"),
    "no_markers": ("# x\n```bash\npip install .\n```\n", "<!-- install -->"),
    "marker_without_block": ("<!-- install -->\nrun pip\n<!-- test -->\n```bash\npytest\n```\n", "<!-- install -->"),
    "unclosed_block": ("<!-- install -->\n```bash\npip install .\n```\n<!-- test -->\n```bash\npytest\n", "<!-- test -->"),
    "empty_block": ("<!-- install -->\n```bash\n\n```\n<!-- test -->\n```bash\npytest\n```\n", "<!-- install -->"),
    "duplicate_marker": (
        "<!-- install -->\n```bash\npip install .\n```\n<!-- test -->\n```bash\npytest\n```\n<!-- test -->\n```bash\nx\n```\n",
        "<!-- test -->",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_READMES))
def test_bad_readme_fails(tmp_path: Path, case: str) -> None:
    readme, marker = BAD_READMES[case]
    result = print_commands(_fake_repo(tmp_path, readme))
    assert result.returncode != 0
    assert marker in result.stderr


@pytest.mark.slow  # makes a venv
def test_run_uses_fresh_venv_and_fails_when_no_tests(tmp_path: Path) -> None:
    # Light stand-ins for the real commands: the install checks it runs inside the new venv, the test
    # exits 5 as pytest does when it collects nothing, which must fail CI.
    readme = (
        '<!-- install -->\n```bash\npython -c "import sys; assert sys.prefix != sys.base_prefix"\n```\n'
        "<!-- test -->\n```bash\nexit 5\n```\n"
    )
    root = _fake_repo(tmp_path / "repo", readme)
    env = {**os.environ, "CI_VENV": str(tmp_path / "venv")}
    result = subprocess.run(["bash", str(root / ".ci" / "run")], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 5, result.stdout + result.stderr
    assert "[ci] install: exit 0" in result.stdout
    assert "[ci] $ exit 5" in result.stdout and "collected no tests" in result.stderr
