"""`slime-dsa sft`: fine-tunes on the tasks' solutions, evaluates greedily, writes a loadable HF directory."""

from __future__ import annotations

import json

import yaml

from slime_dsa.cli import main


def test_sft_lowers_loss_and_writes_a_model(tmp_path):
    from transformers import AutoTokenizer

    import slime_dsa

    recipe = {
        "model": {"preset": "tiny"},
        "data": {"tasks": [{"kind": "arithmetic", "eval_size": 8, "train_size": 150, "task_args": {"max_digits": 1}}],
                 "apply_chat_template": True, "max_prompt_length": 64},
        "rollout": {"max_response_length": 8},
        "trainer": {"learning_rate": 3.0e-3, "num_steps": 12, "micro_batch_tokens": 2048},
        "sft": {"batch_size": 16, "eval_every": 0, "eval_prompts": 8, "output_dir": str(tmp_path / "model")},
        "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled"},
    }
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["sft", str(path)]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["train/loss"] < records[0]["train/loss"]
    assert 0.0 <= records[-1]["eval/pass@1"] <= 1.0
    assert (tmp_path / "run" / "recipe.yaml").exists() and "sft step 12: loss" in (tmp_path / "run" / "sft.log").read_text()
    model = slime_dsa.load_model(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert model.config.vocab_size == len(tokenizer)


def test_sft_on_multi_turn_tool_solutions(tmp_path):
    """SFT on the agentic tasks' reference trajectories (tool output masked), and its eval plays agent rollouts."""
    recipe = {
        "model": {"preset": "tiny"},
        "data": {"tasks": [{"kind": "calc_chain", "eval_size": 2, "train_size": 32},
                           {"kind": "fact_lookup", "eval_size": 2, "train_size": 32}],
                 "apply_chat_template": True, "max_prompt_length": 96},
        "rollout": {"max_response_length": 48},
        "trainer": {"learning_rate": 3.0e-3, "num_steps": 3, "micro_batch_tokens": 2048},
        "sft": {"batch_size": 4, "eval_every": 0, "eval_prompts": 2, "output_dir": str(tmp_path / "model")},
        "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled"},
    }
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["sft", str(path)]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["train/loss"] < records[0]["train/loss"]
    assert "eval/calc_chain/pass@1" in records[-1] and "eval/fact_lookup/pass@1" in records[-1]


def test_sft_rows_without_a_usable_solution_are_one_line_errors():
    """A `kind: dataset` task whose rows have no `solution` column (the docs name only prompt and answer columns) made
    `sft` fail with a ValueError traceback; a solution of the wrong type failed inside the turn layout."""
    from types import SimpleNamespace

    import pytest

    from slime_dsa.config.errors import UserError
    from slime_dsa.data.tokenizer import build_tokenizer
    from slime_dsa.sft import supervised_examples

    tokenizer = build_tokenizer()

    def row(**metadata):
        return SimpleNamespace(task="mine", index=3, prompt_ids=[1, 2], metadata=metadata)

    with pytest.raises(UserError, match=r"task 'mine' row 3: sft learns each row's 'solution' column"):
        supervised_examples([row(answer="4")], tokenizer)
    for bad in (5, ["just a string"], [{"role": "user", "content": "x"}]):
        with pytest.raises(UserError, match=r"task 'mine' row 3, column 'solution'"):
            supervised_examples([row(solution=bad)], tokenizer)
    assert supervised_examples([row(solution="4")], tokenizer)[0].response_ids[-1] == tokenizer.eos_token_id
