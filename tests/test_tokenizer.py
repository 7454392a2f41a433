"""The built-in tokenizer: round trip, digits, special tokens, HF loading, chat template, determinism."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime_dsa.data.tokenizer import (
    EOS_TOKEN,
    MODEL_VOCAB_SIZE,
    SPECIAL_TOKENS,
    TAG_TOKENS,
    TOOL_TAG_TOKENS,
    VOCAB_SIZE,
    build_tokenizer,
    save_tokenizer,
)

TEXTS = [
    "",
    "Compute 123 + 456 * (7 - 8) / 9 = ?",
    "Use the numbers [3, 5, 7] to make 24. <answer>(3 + 5) * 7</answer>",
    "  leading and trailing spaces, tabs\t and newlines\n\n\r\n ",
    "héllo wörld — naïve café; 日本語のテキスト; Ελληνικά; русский; emoji 🙂👍🏽 ; zero-width\u200bjoin",
    "control \x00\x01\x7f bytes and combining e\u0301 and \U0010ffff",
    'json {"name": "calculator", "arguments": {"expression": "3 + 4"}}',
    "Answer: 42<|endoftext|> and <think>reasoning</think>",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < VOCAB_SIZE for i in ids)


def test_round_trip_every_one_and_two_byte_character(tokenizer) -> None:
    text = "".join(chr(c) for c in range(0x800))
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_digits_are_one_token_each(tokenizer) -> None:
    for text in ["0123456789", "x=98765", " 100 + 2000", "(12)*34"]:
        tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode(text, add_special_tokens=False))
        digit_tokens = [t for t in tokens if any(c.isdigit() for c in t)]
        assert digit_tokens == [c for c in text if c.isdigit()], tokens
    # the byte layout: the id of each ASCII digit is its byte value
    assert [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)] == list(range(48, 58))


def test_special_tokens_are_single_ids(tokenizer) -> None:
    ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS)
    assert ids == list(range(VOCAB_SIZE - len(SPECIAL_TOKENS), VOCAB_SIZE))
    for token, token_id in zip(SPECIAL_TOKENS, ids):
        assert tokenizer.encode(f"a{token}b", add_special_tokens=False) == [ord("a"), token_id, ord("b")]
    assert tokenizer.eos_token == tokenizer.pad_token == EOS_TOKEN
    assert len(tokenizer) == VOCAB_SIZE <= MODEL_VOCAB_SIZE and MODEL_VOCAB_SIZE % 64 == 0


def test_skip_special_tokens_keeps_tags(tokenizer) -> None:
    tags = ("<think>hmm</think><tool_call>x\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n</tool_call>"
            "<tool_response>\n1\n</tool_response>")
    ids = tokenizer.encode(f"[gMASK]<sop><|assistant|>\n{tags}<|endoftext|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "\n" + tags
    assert set(TAG_TOKENS) | set(TOOL_TAG_TOKENS) <= set(tokenizer.convert_ids_to_tokens(ids))


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Compute 2 + 3."},
    {"role": "assistant", "content": "<answer>5</answer>", "reasoning_content": "2 + 3 = 5"},
    {"role": "user", "content": [{"type": "text", "text": "Use the calculator."}]},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {"expression": "2 + 3"}}}],
    },
    {"role": "tool", "content": "5"},
    {"role": "tool", "content": "<|endoftext|>"},
]
RENDERED = (
    "[gMASK]<sop><|system|>\nBe brief.<|user|>\nCompute 2 + 3."
    "<|assistant|>\n<think>2 + 3 = 5</think><answer>5</answer><|endoftext|>"
    "<|user|>\nUse the calculator."
    "<|assistant|>\n<tool_call>calc\n<arg_key>expression</arg_key>\n<arg_value>2 + 3</arg_value>\n</tool_call>"
    "<|observation|>\n<tool_response>\n5\n</tool_response>\n<tool_response>\n<|endoftext|>\n</tool_response>"
    "<|assistant|>\n"
)


def test_chat_template(tokenizer) -> None:
    assert tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == RENDERED
    assert tokenizer.apply_chat_template(MESSAGES[:2], tokenize=False) == RENDERED[: RENDERED.index("<|assistant|>")]
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == tokenizer.encode(RENDERED, add_special_tokens=False)
    assert ids[:2] == tokenizer.convert_tokens_to_ids(["[gMASK]", "<sop>"])
    # the eos token ends the assistant turn without tool calls; the one with calls ends at <|observation|>
    assert RENDERED.split("<|observation|>")[0].count(tokenizer.eos_token) == 1


def test_chat_template_rejects_unknown_role(tokenizer) -> None:
    with pytest.raises(Exception, match="unknown chat role robot"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "hi"}], tokenize=False)


def test_auto_tokenizer_loads_saved_dir(tmp_path: Path, tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    directory = save_tokenizer(tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(directory)
    assert isinstance(loaded, PreTrainedTokenizerFast)
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert loaded.eos_token_id == loaded.pad_token_id == tokenizer.eos_token_id
    assert loaded.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == RENDERED
    for text in TEXTS:
        assert loaded.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
        assert loaded.decode(loaded.encode(text, add_special_tokens=False)) == text


def test_build_is_deterministic(tmp_path: Path) -> None:
    first = save_tokenizer(tmp_path / "a") / "tokenizer.json"
    second = save_tokenizer(tmp_path / "b") / "tokenizer.json"
    assert first.read_bytes() == second.read_bytes()
    # a fresh interpreter (new hash seeds) writes the same bytes too
    code = f"from slime_dsa.data.tokenizer import save_tokenizer; save_tokenizer({str(tmp_path / 'c')!r})"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "c" / name).read_bytes()
