"""The rollout's host paths that read engine answers and score them, against their straightforward forms: the answer's
token lists, detokenisation straight through the Rust tokenizer, the countdown verifier's parser without ast, and a
group whose inline rewards run in turn."""

from __future__ import annotations

import ast
import asyncio
import random
import warnings
from fractions import Fraction

import pytest

from rollout.groups import answer_tokens, text_decoder
from rollout.rewards.countdown import _evaluate, parse_expression


def reference_parse(text: str) -> tuple[Fraction, list[int]] | None:
    """parse_expression's ast path, for any text."""
    text = text.strip().strip("$").split("=")[0].strip()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)  # "2(3)": 'int' object is not callable
            tree = ast.parse(text, mode="eval")
        literals: list[int] = []
        return _evaluate(tree.body, literals), literals
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None


def random_expression(rng: random.Random, depth: int = 0) -> str:
    """A well-formed expression, most of the time; sometimes broken by a stray operator, sign or literal."""
    if depth > 3 or rng.random() < 0.35:
        return rng.choice(["0", "00", "07", str(rng.randint(1, 120)), str(rng.randint(1, 9))])
    left, right = random_expression(rng, depth + 1), random_expression(rng, depth + 1)
    op = rng.choice(["+", "-", "*", "/", "/", "//", "**", "- -", "* *", ""])
    space = rng.choice(["", " ", "  "])
    text = f"{left}{space}{op}{space}{right}"
    return f"({text})" if rng.random() < 0.3 else text


@pytest.mark.parametrize("seed", range(4))
def test_the_plain_parser_reads_what_ast_reads(seed: int) -> None:
    rng = random.Random(seed)
    texts = [random_expression(rng) for _ in range(1500)]
    texts += ["".join(rng.choice("0123456789 ()+-*/") for _ in range(rng.randint(1, 14))) for _ in range(3000)]
    texts += ["(" * 99 + "1" + ")" * 99, "1+" * 99 + "1", "()", "(1)(2)", "2(3)", "(1)2", "1 2", "3--4", "1/0",
              "1/(2-2)", "6/4", "0", "00", "007", "+3", "(3)", "((3) * (4))", "100 / 7 * 7", "1 -- 1"]
    for text in texts:
        got, expected = parse_expression(text), reference_parse(text)
        assert got == expected, text
        if got is not None:
            assert type(got[0]) is Fraction and all(type(x) is int for x in got[1]), text


def test_texts_outside_the_plain_characters_still_go_through_ast() -> None:
    for text in ["3 +\t4", "(3 +\n4)", "3 + 4\n", "٣ + 4", "3\u00a0+ 4", "3 × 4", "12 ÷ 4 − 1"]:
        expected = reference_parse(text.replace("×", "*").replace("÷", "/").replace("−", "-"))
        assert parse_expression(text) == expected, repr(text)


def _old_answer_tokens(meta: dict) -> tuple[list[int], list[float], list[int]]:
    ids = [int(tok) for _, tok, *_ in meta["output_token_logprobs"]]
    logprobs = [float(lp) for lp, *_ in meta["output_token_logprobs"]]
    versions = meta.get("output_token_versions") or [int(meta.get("weight_version") or 0)] * len(ids)
    return ids, logprobs, [int(v) for v in versions]


@pytest.mark.parametrize("meta", [
    {"output_token_logprobs": [[-0.5, 7, None], [0, 9, "x"], [-1.25, 3]], "output_token_versions": [2, 2, 3]},
    {"output_token_logprobs": [[-0.5, 7, None]], "weight_version": "4"},
    {"output_token_logprobs": [[-0.5, 7, None]], "output_token_versions": [], "weight_version": None},
    {"output_token_logprobs": []},
])
def test_answer_tokens_read_as_before(meta: dict) -> None:
    got, expected = answer_tokens(meta), _old_answer_tokens(meta)
    assert got == expected
    assert [list(map(type, x)) for x in got] == [list(map(type, x)) for x in expected]


def test_the_decoder_equals_the_tokenizers_decode() -> None:
    from slime_dsa.data.tokenizer import VOCAB_SIZE, build_tokenizer

    tokenizer = build_tokenizer()
    rng = random.Random(0)
    decode = text_decoder(tokenizer)
    sequences = [[rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(0, 70))] for _ in range(300)]
    text = "<think>a</think> <answer>(3 + 4) * 2</answer><|endoftext|>"
    sequences += [tokenizer.encode(text, add_special_tokens=False)]
    for ids in sequences:
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)
    tokenizer.clean_up_tokenization_spaces = True  # then transformers' decode decides: no shortcut
    assert text_decoder(tokenizer)([5, 6]) == tokenizer.decode([5, 6], skip_special_tokens=True)


def test_a_tokenizer_without_a_rust_backend_is_called_as_before() -> None:
    calls = []

    class Words:  # FAKE: any object with decode(ids, skip_special_tokens=...) is a tokenizer to the rollout
        def decode(self, ids, skip_special_tokens=False):
            calls.append(skip_special_tokens)
            return " ".join(map(str, ids))

    assert text_decoder(Words())([1, 2]) == "1 2" and calls == [True]


def test_a_group_scores_each_sample_once_in_order_inline_or_not() -> None:
    """Inline rewards run in turn, others concurrently: the same samples, rewards and counts either way."""
    from rollout.groups import GroupRollout, SampleNumbering
    from slime_dsa.config.schema import RolloutSection
    from slime_dsa.data.prompts import Prompt, Task
    from tests.fake_client import FakeClient

    def run(inline: bool) -> list:
        prompt = Prompt(task="t", split="train", index=0, prompt_ids=[3, 4, 5], prompt_text="", answer="17")
        task = Task(name="t", kind="arithmetic", weight=1.0, reward_fn="arithmetic", train=[prompt], eval=None)
        groups = GroupRollout(FakeClient(vocab_size=20), [task], spaced_ids(), RolloutSection(max_response_length=4))
        assert groups.inline_rewards == {"t": True}  # a built-in verifier
        groups.inline_rewards["t"] = inline
        done = asyncio.run(groups.generate_group(SampleNumbering().new_group(prompt, 8)))
        stats = groups.reward_stats["t"]
        return [(s.index, s.reward, s.status, s.response_text, s.response_ids, s.rollout_logprobs, s.metadata)
                for s in done] + [(stats.calls, stats.failures)]

    in_turn = run(inline=True)
    assert in_turn == run(inline=False)
    assert [r[0] for r in in_turn[:-1]] == list(range(8)) and in_turn[-1] == (8, 0)
    assert {r[1] for r in in_turn[:-1]} == {0.0, 1.0}


def spaced_ids():
    """# FAKE: the fake client's ids are not text; its ids spaced out make each answer's last number its last id."""
    from types import SimpleNamespace

    return SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
