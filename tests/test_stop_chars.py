"""The stop-string skip rule (rollout/engine/stop_chars.py): it never skips a step at which the full tail check stops."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.engine.stop import StopChecker, decode_ids
from rollout.engine.stop_chars import StopCompleters, piece_join
from rollout.engine.types import SamplingParams

ALPHABET = "ab <>/=\n0123456789éß€😀\ufffd"
CORPUS = ["the answer is <answer>42</answer>", "café € 😀 ß straße", "a/b = 3\n<think>no</think>", "😀😀 €€ éé"] * 4


@functools.cache
def builtin_tokenizer():
    from slime_dsa.data.tokenizer import build_tokenizer

    return build_tokenizer()


@functools.cache
def trained_byte_bpe():
    """A byte-level BPE whose merges span multi-byte characters and whole words (its tokens hold parts of characters)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(["<|endoftext|>", "</answer>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


@functools.cache
def word_tokenizer():
    """No decoder: the backend joins token strings with spaces (engine_throughput.py's tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["w0", "w1", "<a>", "</a>", "x=", "=y", "é", "\ufffd", "ab"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


TOKENIZERS = {"builtin": builtin_tokenizer, "byte_bpe": trained_byte_bpe, "words": word_tokenizer}


@st.composite
def cases(draw, name: str):
    tokenizer = TOKENIZERS[name]()
    size = len(tokenizer)
    ids = tokenizer.encode(draw(st.text(alphabet=ALPHABET, max_size=24)), add_special_tokens=False)
    for token in draw(st.lists(st.integers(0, size + 2), max_size=8)):  # any id, split characters, past the vocab
        ids.insert(draw(st.integers(0, len(ids))), token)
    text = decode_ids(tokenizer, ids, False)
    piece = st.text(alphabet=ALPHABET, min_size=1, max_size=4)
    if text:
        start = draw(st.integers(0, len(text) - 1))
        piece = st.one_of(piece, st.integers(start + 1, min(len(text), start + 6)).map(lambda end: text[start:end]))
    stops = draw(st.lists(st.one_of(piece, st.sampled_from(["</answer>", "\n", " ", "</a>"])), min_size=1, max_size=3))
    return tokenizer, ids, stops, draw(st.integers(0, 3))


def assert_never_skips_a_stop(tokenizer, ids: list[int], stops: list[str], min_new_tokens: int) -> int:
    """Walk the output as the engine does; return how many steps the rule skipped."""
    params = SamplingParams(max_new_tokens=len(ids) + 1, min_new_tokens=min_new_tokens, ignore_eos=True, stop=stops)
    stop = StopChecker(params, [], tokenizer, completing=StopCompleters(tokenizer).mask)
    skipped = 0
    for m in range(1, len(ids) + 1):
        reason = stop.check(ids[:m])
        if m >= stop.min_new_tokens and not stop.may_match_after(ids[m - 1], m):
            assert reason is None, (ids[:m], stops, min_new_tokens, decode_ids(tokenizer, ids[:m], False))
            skipped += 1
        if reason is not None:
            break
    return skipped


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_the_skip_rule_never_skips_a_stop(name):
    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(cases(name))
    def check(case):
        assert_never_skips_a_stop(*case)

    check()


def test_the_rule_skips_tokens_without_the_last_character():
    tokenizer = builtin_tokenizer()
    ids = tokenizer.encode("the answer is 12345 and more", add_special_tokens=False)
    assert assert_never_skips_a_stop(tokenizer, ids, ["</answer>"], 0) == len(ids)
    mask = StopCompleters(tokenizer).mask(["</answer>"])
    flags = {token: mask[tokenizer.convert_tokens_to_ids(token)] for token in (">", "</think>", "7", "Ġthe")}
    assert flags == {">": 1, "</think>": 1, "7": 0, "Ġthe": 0}
    assert mask[0xE2]  # a lead byte alone: U+FFFD, its text exists only in context


def test_first_check_after_min_new_tokens_is_full():
    tokenizer = builtin_tokenizer()
    ids = tokenizer.encode("x</answer>yyyy", add_special_tokens=False)
    params = SamplingParams(max_new_tokens=32, min_new_tokens=len(ids), ignore_eos=True, stop=["</answer>"])
    stop = StopChecker(params, [], tokenizer, completing=StopCompleters(tokenizer).mask)
    assert stop.may_match_after(ids[-1], len(ids)) and stop.check(ids)["matched"] == "</answer>"
    assert not stop.may_match_after(ids[-1], len(ids) + 1)


def test_unvouched_decoders_and_strings_never_skip():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    sentencepiece = Tokenizer(models.WordLevel({"▁a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    sentencepiece.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=sentencepiece, clean_up_tokenization_spaces=False)
    assert piece_join(tokenizer) is None and StopCompleters(tokenizer).mask(["b"]) is None
    cleaned = PreTrainedTokenizerFast(tokenizer_object=builtin_tokenizer().backend_tokenizer, clean_up_tokenization_spaces=True)
    assert piece_join(cleaned) is None
    completers = StopCompleters(builtin_tokenizer())
    assert completers.mask(["ok", "\ufffd"]) is None and completers.mask([""]) is None
    assert StopCompleters(word_tokenizer()).mask(["a b"]) is not None and StopCompleters(word_tokenizer()).mask(["a "]) is None
