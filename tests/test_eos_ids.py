"""Which tokens end an answer in the embedded engine: as SGLang's, config.json's eos_token_id united with
generation_config.json's and the tokenizer's eos_token; a generation_config.json SGLang cannot read is skipped."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from rollout.engine import GenerateRequest, SamplingParams

VOCAB = 64
CONFIG_EOS = 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random checkpoint whose config.json says eos_token_id 1, saved without a tokenizer."""
    from slime_dsa.checkpoint import build_model, save_pretrained
    from slime_dsa.models.presets import preset_config

    directory = tmp_path_factory.mktemp("eos_model")
    save_pretrained(build_model(preset_config("tiny", vocab_size=VOCAB, eos_token_id=CONFIG_EOS), seed=0), directory)
    return directory


def greedy_answer(model_dir: Path, max_new_tokens: int = 12) -> tuple[list[int], dict]:
    """(output ids, finish reason) of one greedy answer from an engine loaded from `model_dir`."""
    from rollout.server.launch import load_engine

    engine = load_engine(model_dir, max_cache_tokens=256)[0].engine
    engine.add_request(GenerateRequest(input_ids=[3, 4, 5, 6], rid="r",
                                       sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)))
    final = None
    while engine.has_work:
        for out in engine.step():
            final = out if out.finish_reason is not None else final
    return final.output_ids, final.finish_reason


def write_generation_config(model_dir: Path, text: str) -> Path:
    (path := model_dir / "generation_config.json").write_text(text)
    return path


def test_generation_config_eos_ids_end_the_answer(model_dir):
    """A checkpoint whose generation_config.json lists [1, t] stops at t, as SGLang does (it unites both files)."""
    (model_dir / "generation_config.json").unlink(missing_ok=True)
    free, reason = greedy_answer(model_dir)
    stop_at = next(t for t in free[2:] if t not in (0, CONFIG_EOS))  # mid-answer; 0 is falsy to SGLang alone
    write_generation_config(model_dir, json.dumps({"eos_token_id": [CONFIG_EOS, stop_at]}))
    try:
        out, reason = greedy_answer(model_dir)
    finally:
        (model_dir / "generation_config.json").unlink()
    assert reason == {"type": "stop", "matched": stop_at}
    assert out == free[: free.index(stop_at) + 1]


def test_generation_config_as_sglang_reads_it(tmp_path, caplog):
    """An int or a list; no file, a falsy value (0, [], null) or unreadable JSON adds nothing (SGLang skips them);
    entries that are not ints are dropped with a warning naming the file and field."""
    from slime_dsa.models.config import generation_eos_token_ids

    assert generation_eos_token_ids(tmp_path) == []
    for text, expected in (('{"eos_token_id": 7}', [7]), ('{"eos_token_id": [7, 9, 7]}', [7, 9]),
                           ('{"eos_token_id": 0}', []), ('{"eos_token_id": []}', []), ('{"eos_token_id": null}', []),
                           ('{"do_sample": true}', [])):
        write_generation_config(tmp_path, text)
        assert generation_eos_token_ids(tmp_path) == expected, text
    with caplog.at_level(logging.WARNING):
        path = write_generation_config(tmp_path, "{not json")
        assert generation_eos_token_ids(tmp_path) == []
        assert f"{path} is not readable JSON" in caplog.text
        caplog.clear()
        write_generation_config(tmp_path, '{"eos_token_id": [7, "8", 2.0, true]}')
        assert generation_eos_token_ids(tmp_path) == [7]
        assert f"{path}: eos_token_id holds '8', 2.0, True" in caplog.text


def test_engine_stop_ids_unite_config_generation_config_and_tokenizer():
    """config.json ∪ generation_config.json ∪ the tokenizer's eos_token (and Llama 3's <|eom_id|>), as SGLang's Req."""
    from rollout.engine.stop import engine_eos_token_ids

    class Tokenizer:
        eos_token_id = 11

        def get_added_vocab(self) -> dict[str, int]:
            return {"<|eom_id|>": 12}

    assert engine_eos_token_ids([1], [5, 1], None) == [1, 5]
    assert engine_eos_token_ids([1], [5, 1], Tokenizer()) == [1, 5, 11, 12]
    assert engine_eos_token_ids([], [], None) == []


def test_a_checkpoint_and_its_export_keep_generation_config(model_dir, tmp_path):
    """A run's checkpoint carries model.path's generation_config.json and `export` copies it on, so an exported
    model stops where the run's engines did."""
    import shutil

    from slime_dsa.checkpoint.training import CheckpointManager, export_checkpoint
    from slime_dsa.orchestrator.step import save_checkpoint

    class Trainers:
        def save_checkpoint(self, directory: str) -> None:
            shutil.copy2(model_dir / "model.safetensors", directory)

    source = tmp_path / "model"
    shutil.copytree(model_dir, source)
    text = write_generation_config(source, '{"eos_token_id": [1, 5]}').read_text()
    ckpts = CheckpointManager(tmp_path / "checkpoints")
    save_checkpoint(ckpts, 1, Trainers(), {"next": 1}, source)
    assert (ckpts.path_for(1) / "generation_config.json").read_text() == text
    export_checkpoint(ckpts.path_for(1), tmp_path / "export")
    assert (tmp_path / "export" / "generation_config.json").read_text() == text
