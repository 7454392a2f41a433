"""benchmarks/sao_vs_grpo.py's report: seeds and algorithms run apart merge into one section, with a verdict per
seed that says when GRPO's target is no better than its start."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "sao_vs_grpo.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("sao_vs_grpo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _points(rewards: list[float], tokens_per_eval: int = 1000) -> list[dict]:
    return [{"step": 10 * i, "tokens": tokens_per_eval * i, "reward": r, "pass1": r} for i, r in enumerate(rewards)]


def _result(bench, tmp_path: Path, seed: int, algorithms: str, curves: dict) -> Path:
    args = {
        "task": "calc_chain", "task_args": "{}", "model": "m", "steps": 20, "samples_per_step": 64, "group_size": 8,
        "max_prompt_length": 96, "max_response_length": 192, "eval_size": 128, "eval_every": 10, "lr": 5e-4,
        "grpo_lr": None, "lr_warmup": 5, "critic_lr": 2.5e-3, "critic_updates": 2, "critic_warmup": 5,
        "dis_eps_low": 0.3, "dis_eps_high": 5.0, "max_staleness": 1, "seed": seed}
    work = tmp_path / f"{seed}-{algorithms}"
    work.mkdir()
    result = {"seed": seed, "args": args, "command": f"cmd {seed} {algorithms}", "curves": curves,
              "seconds": {name: 10.0 for name in curves}, "load": 3.0}
    (work / "result.json").write_text(json.dumps(result))
    return work


def test_verdict_by_tokens_to_grpo_final_or_ending_higher(bench):
    grpo = _points([0.2, 0.3, 0.4])
    early = bench.verdict(grpo, _points([0.2, 0.45, 0.38]))  # passes 0.4 at half GRPO's tokens, ends lower
    assert "1000 = 0.50x" in early and "Goal (<= 0.7x the tokens, or ends higher): met" in early
    assert "NOT met" in bench.verdict(grpo, _points([0.2, 0.25, 0.4]))  # reached at 1.0x, ends equal
    assert "says little" in bench.verdict(_points([0.3, 0.2, 0.25]), _points([0.3, 0.3, 0.3]))


def test_combine_merges_algorithms_run_apart_and_reports_each_seed(bench, tmp_path):
    dirs = [_result(bench, tmp_path, 7, "grpo", {"grpo": _points([0.2, 0.3, 0.4])}),
            _result(bench, tmp_path, 7, "sao", {"sao": _points([0.2, 0.5, 0.6])}),
            _result(bench, tmp_path, 8, "grpo,sao", {"grpo": _points([0.3, 0.3, 0.35]),
                                                     "sao": _points([0.3, 0.3, 0.3])})]
    out = tmp_path / "results.md"
    assert bench.main(["--combine", *map(str, dirs), "--out", str(out), "--plot", str(tmp_path / "c.png")]) == 0
    text = out.read_text()
    assert text.count("| 7 | ") == 2 and text.count("| 8 | ") == 2
    assert "- seed 7: " in text and "- seed 8: " in text and "cmd 7 sao" in text
    assert (tmp_path / "c.png").stat().st_size > 0
