"""Teachers score by prefill only, over SGLang's /generate protocol, against real embedded servers on 127.0.0.1: the
scores equal a direct forward of the teacher over the same ids (float32, CPU, 1e-5) whether the teacher has a server
of its own or takes turns on a shared engine (swapped in from host memory); a wrong reply is refused naming the
teacher; a tokenizer that differs from the student's stops the run in one line."""

from __future__ import annotations

import asyncio
import json

import pytest
import requests
import torch

from rollout.client import MalformedResponseError
from rollout.teachers import DirectScorer, SwapEngine, parse_scores, score_payload
from tests.teacher_helpers import ServerThread, direct_scores, make_expert

PROMPT = [5, 17, 42, 9, 11]
SEQUENCES = [PROMPT + [33, 7, 90, 101], PROMPT + [64, 2], [3, 8] + [77, 70, 71, 72, 73, 1]]
PROMPT_LENS = [5, 5, 2]


@pytest.fixture(scope="module")
def experts(tmp_path_factory):
    return [make_expert(tmp_path_factory.mktemp(f"expert{seed}"), seed) for seed in (0, 1)]


def _assert_scores(model_dir, scores, temperature, top_k):
    for seq, p, got in zip(SEQUENCES, PROMPT_LENS, scores):
        chosen, ids, values = direct_scores(model_dir, seq, p, temperature, top_k)
        assert len(got.logprobs) == len(seq) - p
        assert torch.allclose(torch.tensor(got.logprobs, dtype=torch.float32), chosen, atol=1e-5, rtol=0)
        if top_k:
            assert torch.equal(torch.from_numpy(got.topk_ids).long(), ids)
            assert torch.allclose(torch.from_numpy(got.topk_logprobs), values, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 4)])
def test_a_server_of_its_own_scores_like_a_direct_forward(experts, temperature, top_k):
    """The SGLang-protocol path (serving embedded, sglang and external all score through it)."""
    srv = ServerThread(experts[0])
    try:
        async def score():
            scorer = DirectScorer("calc", [srv.url], temperature=temperature, top_k=top_k)
            try:
                return await scorer.score(SEQUENCES, PROMPT_LENS), scorer.stats
            finally:
                await scorer.close()

        scores, stats = asyncio.run(score())
        _assert_scores(experts[0], scores, temperature, top_k)
        assert (stats.requests, stats.samples, stats.response_tokens) == (1, 3, 4 + 2 + 6)
        # the raw reply is SGLang's: entries from logprob_start_len, the first None, the temperature echoed
        payload = score_payload(SEQUENCES[:1], PROMPT_LENS[:1], temperature, top_k)
        body = requests.post(srv.url + "/generate", json=payload, timeout=60).json()
        meta = body[0]["meta_info"]
        assert meta["completion_tokens"] == 0 and meta["output_token_logprobs"] == []
        assert meta["input_token_logprobs"][0] == [None, PROMPT[-1], None]
        assert [e[1] for e in meta["input_token_logprobs"]] == SEQUENCES[0][4:]
        assert meta["input_logprob_temperature"] == temperature
    finally:
        srv.stop()


def test_teachers_swapped_into_one_engine_score_like_their_own_forward(experts):
    srv = ServerThread(experts[0], preload_weights=[str(e) for e in experts])
    try:
        async def score():
            engine = SwapEngine("shared", srv.url, temperature=0.7, top_k=3)
            a, b = engine.add("a", str(experts[0])), engine.add("b", str(experts[1]))
            try:
                # both teachers' requests at once: the engine takes them in turns, each under its own weights
                got = await asyncio.gather(a.score(SEQUENCES, PROMPT_LENS), b.score(SEQUENCES, PROMPT_LENS),
                                           a.score(SEQUENCES[:1], PROMPT_LENS[:1]))
                return got, a.stats, b.stats
            finally:
                await engine.close()

        (scores_a, scores_b, again), stats_a, stats_b = asyncio.run(score())
        _assert_scores(experts[0], scores_a, 0.7, 3)
        _assert_scores(experts[1], scores_b, 0.7, 3)
        assert torch.allclose(torch.tensor(again[0].logprobs), torch.tensor(scores_a[0].logprobs), atol=1e-5)
        assert stats_a.swaps >= 1 and stats_b.swaps == 1 and stats_a.swap_s > 0
        info = requests.get(srv.url + "/get_server_info", timeout=10).json()
        assert info["stats_scored_tokens"] > 0
    finally:
        srv.stop()


def test_a_reply_that_does_not_fit_is_refused_naming_the_teacher():
    seq, p = SEQUENCES[1], PROMPT_LENS[1]
    entries = [[None, seq[p - 1], None]] + [[-1.0, t, None] for t in seq[p:]]
    good = [{"meta_info": {"input_token_logprobs": entries, "weight_version": "0"}}]
    assert parse_scores(good, "teacher 't'", [seq], [p], 1.0)[0].logprobs == [-1.0, -1.0]
    with pytest.raises(MalformedResponseError, match="teacher 't'.*temperature 1.0, not the rollout's 0.7"):
        parse_scores(good, "teacher 't'", [seq], [p], 0.7)
    shifted = [{"meta_info": {"input_token_logprobs": entries[1:] + [[-1.0, 5, None]]}}]
    with pytest.raises(MalformedResponseError, match="other token ids"):
        parse_scores(shifted, "teacher 't'", [seq], [p], 1.0)
    with pytest.raises(MalformedResponseError, match="weight_version '0', expected 'teacher:b'"):
        parse_scores(good, "teacher 't'", [seq], [p], 1.0, weight_version="teacher:b")


def test_a_tokenizer_mismatch_stops_the_run_in_one_line(tmp_path, experts):
    from transformers import AutoTokenizer

    from slime_dsa.config import validate_recipe
    from slime_dsa.config.errors import UserError
    from slime_dsa.orchestrator.teachers import check_tokenizers

    odd = tmp_path / "odd"
    odd.mkdir()
    for f in experts[1].iterdir():
        (odd / f.name).write_bytes(f.read_bytes())
    text = (odd / "tokenizer.json").read_text()
    (odd / "tokenizer.json").write_text(text.replace('"<|endoftext|>"', '"<|end|>"'))
    recipe = validate_recipe({"algorithm": {"name": "opd"}, "rollout": {"n_samples_per_prompt": 1},
                              "data": {"tasks": [{"kind": "arithmetic"}, {"kind": "countdown"}]},
                              "teachers": [{"name": "good", "path": str(experts[0]), "domains": ["arithmetic"]},
                                           {"name": "odd", "path": str(odd), "domains": ["countdown"]}]})
    student = AutoTokenizer.from_pretrained(str(experts[0]))
    with pytest.raises(UserError) as info:
        check_tokenizers(recipe.teachers, student)
    message = str(info.value)
    assert message.startswith(f"teacher 'odd' ({odd}): its tokenizer differs from the student's")
    assert f"{len(student) + 1} tokens against {len(student)}" in message and "\n" not in message
    check_tokenizers(recipe.teachers[:1], student)  # the same tokenizer passes
    logits = json.loads((experts[0] / "config.json").read_text())["vocab_size"]
    check_tokenizers(recipe.teachers[:1], student, logits)
    with pytest.raises(UserError, match=f"its model has {logits} logits against the student's {logits + 64}; "):
        check_tokenizers(recipe.teachers[:1], student, logits + 64)


def test_a_teacher_with_fewer_logits_than_the_highest_token_id_is_one_line(tmp_path):
    """A teacher's logits were checked against len(student tokenizer): with holes in its ids (390 tokens, one of them
    id 450) a teacher of 420 logits passed, and its engine failed on id 450 mid-run. Now checked against the highest
    id + 1."""
    import shutil

    from transformers import AutoTokenizer

    from slime_dsa.config import validate_recipe
    from slime_dsa.config.errors import UserError
    from slime_dsa.orchestrator.teachers import check_tokenizers
    from tests.test_run_dir import _tokenizer_with_holes

    student_dir, _ = _tokenizer_with_holes(tmp_path / "student")
    teacher = tmp_path / "teacher"
    shutil.copytree(student_dir, teacher)
    (teacher / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa", "vocab_size": 420}))
    recipe = validate_recipe({"algorithm": {"name": "opd"}, "rollout": {"n_samples_per_prompt": 1},
                              "teachers": [{"name": "t", "path": str(teacher), "domains": ["arithmetic"]}]})
    with pytest.raises(UserError) as info:
        check_tokenizers(recipe.teachers, AutoTokenizer.from_pretrained(student_dir))
    assert str(info.value) == (f"teacher 't' ({teacher}): its model has 420 logits, fewer than the tokenizer's 451 "
                               "tokens")
