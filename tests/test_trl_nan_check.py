"""benchmarks/trl_nan_check.py: the step-4 cut (one completion shortened, EOS then padding, out of the loss) and,
slow, TRL's real loss and backward on a tiny policy with zero advantages (finite on CPU: 0 loss, 0 gradient)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.trl_nan_check import cut_one, main, parse_args


def test_cut_one_shortens_the_longest_completion() -> None:
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 2, 2, 2]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    inputs = {"completion_ids": ids, "completion_mask": mask, "num_items_in_batch": mask.sum()}
    assert cut_one(inputs, keep=2, eos=3, pad=2) == 0
    assert inputs["completion_ids"][0].tolist() == [5, 3, 2, 2, 2]
    assert inputs["completion_mask"].tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert int(inputs["num_items_in_batch"]) == 5


def test_attention_settings_are_checked() -> None:
    assert parse_args(["--model", "m"]).attn == ["sdpa", "sdpa-math", "sdpa-eff", "sdpa-cudnn", "eager"]
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--attn", "sdpa,flash"])


@pytest.mark.slow
def test_tiny_policy_zero_advantages_give_zero_gradients_on_cpu(tmp_path, capsys) -> None:
    pytest.importorskip("trl")
    from slime_dsa.checkpoint import build_model, save_pretrained
    from slime_dsa.data.tokenizer import build_tokenizer
    from slime_dsa.models.presets import preset_config

    tokenizer = build_tokenizer()
    config = preset_config("tiny", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, index_topk=512)
    save_pretrained(build_model(config, seed=0), tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert main(["--model", str(tmp_path), "--completions", "reference", "--batch", "4", "--group-size", "2",
                 "--rounds", "1", "--attn", "sdpa,eager"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert len(lines) == 2 and all("loss        0  grad_norm 0  non-finite grads 0  first NaN: -" in x for x in lines)
