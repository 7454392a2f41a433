"""Malformed dataset rows: `slime-dsa train` on a dataset task fails in one line naming the file (and the row where
there is one), before Ray or any engine starts, for each way a row can be wrong."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from slime_dsa.cli import main

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
GOOD = json.dumps({"prompt": "1+1", "answer": "2"}) + "\n"
CASES = {
    "not_json": (GOOD + '{"prompt": "2+2", "answer": \n', "row 1: not valid JSON"),
    "not_an_object": (GOOD + '[1, 2]\n', "row 1: expected a JSON object"),
    "no_prompt_column": (json.dumps({"question": "1+1", "answer": "2"}) + "\n", "no column 'prompt'"),
    "null_answer": (GOOD + json.dumps({"prompt": "2+2", "answer": None}) + "\n", "row 1"),
    "empty_prompt": (GOOD + json.dumps({"prompt": "", "answer": "4"}) + "\n", "row 1"),
    "number_prompt": (GOOD + json.dumps({"prompt": 4, "answer": "4"}) + "\n", "row 1"),
    "bad_messages": (GOOD + json.dumps({"prompt": [{"content": "hi"}], "answer": "4"}) + "\n", "row 1"),
    "non_utf8": (GOOD.encode() + b'{"prompt": "caf\xe9", "answer": "4"}\n', "not valid UTF-8"),
}


@pytest.fixture(autouse=True)
def fresh_logging(monkeypatch):
    """main() and the datasets library set up logging on the stderr of their first call; each test's is new."""
    import logging

    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(logging.getLogger("datasets"), "handlers", [])


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_malformed_row_is_one_line_before_anything_starts(case, tmp_path, capsys, figures):
    content, words = CASES[case]
    data = tmp_path / "train.jsonl"
    data.write_bytes(content if isinstance(content, bytes) else content.encode())
    start = time.perf_counter()
    code = main(["train", str(ROOT / "recipes" / "base.yaml"), "--set", "model.preset=tiny",
                 "--set", f"data.tasks=[{{name: t, kind: dataset, path: {data}, eval_size: 0}}]",
                 "--set", "data.apply_chat_template=false",
                 "--set", f"logging.run_dir={tmp_path / 'run'}", "--set", "logging.wandb_mode=disabled"])
    _, err = capsys.readouterr()
    (line,) = [line for line in err.splitlines() if line.startswith("slime-dsa: error: ")]
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert str(data) in line and words in line, line
    assert time.perf_counter() - start < 60
    figures.setdefault("dataset_rows", {})[case] = line.removeprefix("slime-dsa: error: ").replace(str(data), "FILE")
    # checkpoints/ holds only the lock the run takes for it (f665c07): no checkpoint
    assert not list((tmp_path / "run" / "checkpoints").glob("step_*"))
    assert "engine(s) up" not in (tmp_path / "run" / "train.log").read_text()
