"""A run directory's files rewritten on a resume or a restart (metrics.jsonl cut back to the resumed step,
recipe.yaml, run_dir/initial_model and its config.json) survive a write that fails halfway: they hold the old contents
or the new, never a part. The failure is real: the code runs in a child process under a file-size limit
(RLIMIT_FSIZE), whose writes past it fail with EFBIG as on a full disk. Before, each was rewritten in place: the
metrics of every kept step, the recipe or the model's config were lost, or a half-copied initial_model was reused."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ASSET = ROOT / "recipes" / "assets" / "quickstart-sft"


def run_with_file_limit(code: str, limit: int) -> subprocess.CompletedProcess:
    """Run `code` in a child Python whose files cannot grow past `limit` bytes (a write past it raises EFBIG)."""
    preamble = textwrap.dedent(f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY))
    """)
    return subprocess.run([sys.executable, "-c", preamble + textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_metrics_cut_back_on_resume_keep_every_record_when_the_rewrite_fails(tmp_path):
    lines = [json.dumps({"step": step, "elapsed_s": float(step), "train/loss": 0.5}) for step in range(1, 41)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in lines))
    done = run_with_file_limit(f"""
        from slime_dsa.logging.metrics import MetricsLogger
        MetricsLogger({str(tmp_path)!r}, "p", None, "disabled", resume_step=30)
    """, limit=200)
    assert done.returncode != 0 and "File too large" in done.stderr, done.stderr[-2000:]
    assert metrics.read_text().splitlines() == lines
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file left


def test_recipe_yaml_is_whole_when_its_rewrite_fails(tmp_path):
    from slime_dsa.config import load_recipe
    from slime_dsa.run_dir import write_resolved_recipe

    write_resolved_recipe(load_recipe(None, ["rollout.temperature=0.5"]), tmp_path)
    before = (tmp_path / "recipe.yaml").read_text()
    done = run_with_file_limit(f"""
        from pathlib import Path
        from slime_dsa.config import load_recipe
        from slime_dsa.run_dir import write_resolved_recipe
        write_resolved_recipe(load_recipe(None, ["rollout.temperature=0.7"]), Path({str(tmp_path)!r}))
    """, limit=100)
    assert done.returncode != 0 and "File too large" in done.stderr, done.stderr[-2000:]
    assert (tmp_path / "recipe.yaml").read_text() == before


@pytest.mark.parametrize("first_budget", [None, 16], ids=["copy", "config"])
def test_initial_model_is_whole_when_its_copy_or_config_rewrite_fails(tmp_path, first_budget):
    """copy: the copy of model.path with a new index_topk stops at the weights (config.json and tokenizer copied);
    the next start reused the half-copied directory. config: the rewrite of a reused copy's config.json for a changed
    index_topk stops halfway; the next start read a broken config.json."""
    from slime_dsa.checkpoint.validate import model_dir_problem
    from slime_dsa.config import load_recipe
    from slime_dsa.run_dir import prepare_model_dir

    def recipe(budget: int) -> list[str]:
        return [f"model.path={ASSET}", f"model.index_topk={budget}"]

    if first_budget is not None:
        prepare_model_dir(load_recipe(None, recipe(first_budget)), tmp_path)
    done = run_with_file_limit(f"""
        from pathlib import Path
        from slime_dsa.config import load_recipe
        from slime_dsa.run_dir import prepare_model_dir
        prepare_model_dir(load_recipe(None, {recipe(24)!r}), Path({str(tmp_path)!r}))
    """, limit=512 if first_budget else 64 * 1024)
    assert done.returncode != 0 and "File too large" in done.stderr, done.stderr[-2000:]
    model_dir = prepare_model_dir(load_recipe(None, recipe(24)), tmp_path)
    assert model_dir_problem(model_dir) is None
    assert json.loads((model_dir / "config.json").read_text())["index_topk"] == 24
    assert (model_dir / "model.safetensors").read_bytes() == (ASSET / "model.safetensors").read_bytes()


def test_rollout_ledger_cut_back_on_resume_is_whole_when_its_rewrite_fails(tmp_path):
    """The async loop's ledger drops the steps past the resumed checkpoint; before, a failed rewrite left a partial
    rollout_ledger.tmp in the run directory (and the rewrite was never fsynced)."""
    lines = [json.dumps({"step": step, "trainer_version": step, "trained": [step]}) for step in range(1, 41)]
    ledger = tmp_path / "rollout_ledger.jsonl"
    ledger.write_text("".join(line + "\n" for line in lines))
    done = run_with_file_limit(f"""
        from pathlib import Path
        from slime_dsa.orchestrator.async_loop import Ledger
        Ledger(Path({str(ledger)!r}), resume_step=30)
    """, limit=200)
    assert done.returncode != 0 and "File too large" in done.stderr, done.stderr[-2000:]
    assert ledger.read_text().splitlines() == lines
    assert [p.name for p in tmp_path.iterdir()] == ["rollout_ledger.jsonl"]  # no temporary file left
