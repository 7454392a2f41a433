"""The decode loop's device-side pieces: seeded uniforms (splitmix64 on int64 tensors), the sampling rows kept on the
device across batch changes, stop tokens and lengths checked on the device against StopChecker, and the batched
stop-string decode. CPU."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.engine.rows import LENGTH, RUNNING, STOP_TOKEN, TAIL_DECODE, TAIL_SKIP, CompleterTable, SamplingRows, row_spec
from rollout.engine.sample_graph import seeded_uniforms
from rollout.engine.sampling import cached_arange, counter_uniforms, seed_to_int64
from rollout.engine.stop import StopChecker, decode_tails
from rollout.engine.types import SamplingParams

VOCAB = 50
MASK64 = 2**64 - 1


def splitmix64_uniform(seed: int, n: int) -> float:
    """Vigna's splitmix64, output n of a generator seeded with `seed`, top 53 bits as a float (pure Python)."""
    z = (seed + (n + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return ((z ^ (z >> 31)) >> 11) * 2.0**-53


def test_counter_uniforms_are_splitmix64_with_wraparound():
    r = random.Random(0)
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1] + [r.randrange(-(2**63), 2**64) for _ in range(200)]
    counters = [0, 1, 2, 3, 10**6, 2**40] + [r.randrange(0, 100_000) for _ in range(200)]
    got = counter_uniforms(torch.tensor([seed_to_int64(s) for s in seeds]), torch.tensor(counters))
    expect = torch.tensor([splitmix64_uniform(s & MASK64, n) for s, n in zip(seeds, counters)], dtype=torch.float64)
    assert torch.equal(got, expect)
    many = counter_uniforms(torch.full((20_000,), 7), torch.arange(20_000))
    assert 0 <= many.min() and many.max() < 1 and abs(many.mean().item() - 0.5) < 0.01


def _spec(i: int, params: SamplingParams):
    stop = StopChecker(params, eos_token_ids=[1])
    return row_spec(params, stop, seed_to_int64(1000 + i), VOCAB, stream=i % 3 == 0)


PARAMS = [
    SamplingParams(temperature=0.0, max_new_tokens=5),
    SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=9, stop_token_ids=[3, 4, 7], min_new_tokens=2),
    SamplingParams(temperature=1.0, top_k=5, max_new_tokens=3, ignore_eos=True),
    SamplingParams(temperature=1.3, min_p=0.1, max_new_tokens=12, stop_token_ids=[9]),
    SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True, stop_token_ids=[2, 5, 6, 8, 11]),
    SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, stop_token_ids=[2, 9], min_new_tokens=3),
]


def _same(a: SamplingRows, b: SamplingRows) -> None:
    assert a.key == b.key and a.flags == b.flags and a.string_rows == b.string_rows and a.stream_rows == b.stream_rows
    assert (a.row_flags == b.row_flags).all()
    assert torch.equal(a.floats, b.floats) and torch.equal(a.ints, b.ints)
    # Widths may differ by padding: compare the sets of stop ids per row.
    for x, y in zip(a.stop_ids.tolist(), b.stop_ids.tolist()):
        assert set(x) - {-1} == set(y) - {-1}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 11), unique=True, max_size=8), min_size=1, max_size=6))
def test_updated_rows_equal_rows_built_from_scratch(batches):
    """Requests leave, join and reorder from step to step: the rows kept on the device equal a fresh build."""
    specs = {i: _spec(i, PARAMS[i % len(PARAMS)]) for i in range(12)}
    rows = None
    for batch in batches:
        key = tuple(batch)
        fresh = SamplingRows.build(key, [specs[i] for i in key], torch.device("cpu"))
        rows = fresh if rows is None else rows.update(key, [specs[i] for i in key])
        _same(rows, fresh)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.lists(st.integers(0, 11), unique=True, min_size=1, max_size=8)),
                min_size=1, max_size=90), st.sampled_from([torch.float64, torch.float32]))
def test_uniforms_drawn_ahead_equal_the_hash_of_each_step(steps, dtype):
    """Steps over the same rows (follows), over rows that only left or reordered (update with index: the draws made
    ahead are kept), over new rows, and steps whose sampling graph hashed its own (kind 4: seeded_uniforms, then the
    rows drop their draws): every step's uniforms are counter_uniforms of its seeds and counts, cast."""
    specs = {i: _spec(i, PARAMS[1 + i % 4]) for i in range(12)}  # all sampled
    seeds = torch.tensor([specs[i].ints[2] for i in range(12)])
    counts = {i: 3 * i for i in range(12)}  # tokens before this one, per request
    rows, last_key = None, None
    for kind, batch in steps:
        key = tuple(batch) if kind not in (0, 4) or last_key is None else last_key  # kinds 0, 4: the same rows
        if rows is None or kind == 3:  # kind 3: rows built afresh
            rows, follows = SamplingRows.build(key, [specs[i] for i in key], torch.device("cpu")), False
        else:
            where = dict(zip(rows.key, range(len(rows.key))))
            index = np.array([where.get(i, -1) for i in key], dtype=np.int64)
            follows = bool((index >= 0).all())
            rows = rows.update(key, [specs[i] for i in key], index if kind != 2 else None)  # kind 2: index unknown
        num_output = torch.tensor([counts[i] for i in key])
        if kind == 4:  # a graphed step (sample_graph.py)
            got = seeded_uniforms(rows, num_output, dtype)
            rows.drop_draws()
        else:
            got = rows.uniforms(num_output, follows=follows, dtype=dtype)
        assert torch.equal(got, counter_uniforms(seeds[list(key)], num_output).to(dtype))
        for i in key:
            counts[i] += 1
        last_key = key


def test_cached_arange_is_made_once():
    a = cached_arange(7, torch.device("cpu"))
    assert torch.equal(a, torch.arange(7)) and cached_arange(7, torch.device("cpu")) is a


@settings(max_examples=200, deadline=None)
@given(st.integers(0, len(PARAMS) - 1), st.integers(0, 14), st.integers(0, VOCAB - 1))
def test_finish_codes_follow_the_stop_checker(p, n_before, token):
    """Length, min_new_tokens and stop tokens on the device: the same verdict as StopChecker.check on the host."""
    params = PARAMS[p]
    stop = StopChecker(params, eos_token_ids=[1])
    rows = SamplingRows.build((0, 1), [_spec(0, PARAMS[(p + 1) % len(PARAMS)]), _spec(p, params)], torch.device("cpu"))
    codes = rows.finish_codes(torch.tensor([0, token]), torch.tensor([0, n_before]))
    reason = stop.check([0] * n_before + [token])
    expect = RUNNING if reason is None else LENGTH if reason["type"] == "length" else STOP_TOKEN
    assert codes[1].item() == expect
    counted = rows.finish_codes(torch.tensor([0, token]), torch.tensor([0, n_before]),
                                count=torch.tensor([1, n_before + 1]))
    assert torch.equal(counted, codes)


class _CharTokenizer:
    """Token id i is the character chr(97 + i % 26): enough for StopChecker's window."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - 97 for c in text]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 3), st.integers(0, 14), st.integers(0, VOCAB - 1), st.booleans(), st.integers(0, 3))
def test_tail_codes_follow_may_match_after(p, n_before, token, streams, mask_kind):
    """Rows with stop strings: TAIL_DECODE exactly where the host's rule (StopChecker.check reaching the strings, then
    may_match_after) decodes the tail, TAIL_SKIP where it checks without decoding; the others as without strings."""
    masks = [None, bytes(VOCAB), bytes([i % 3 == 0 for i in range(VOCAB)]), bytes([1, 0] * 10)]  # the last is short
    mask = masks[mask_kind]
    params = [SamplingParams(temperature=1.0, max_new_tokens=9, stop=["ab"]),
              SamplingParams(temperature=0.0, max_new_tokens=12, stop=["x", "yz"], min_new_tokens=3),
              SamplingParams(temperature=1.0, max_new_tokens=6, stop=["q"], stop_token_ids=[4], min_new_tokens=2),
              SamplingParams(temperature=1.0, max_new_tokens=8, stop=["q"], ignore_eos=True, min_new_tokens=5)][p]
    stop = StopChecker(params, eos_token_ids=[1], tokenizer=_CharTokenizer(), completing=lambda strings: mask)
    table = CompleterTable(VOCAB, torch.device("cpu"))
    table.row(masks[2])  # another request's mask first: rows are not all 1
    spec = row_spec(params, stop, seed_to_int64(3), VOCAB, stream=streams, completer=table.row(stop.completing))
    plain = _spec(0, PARAMS[2])  # no stop strings: never a tail code
    rows = SamplingRows.build((0, 1), [plain, spec], torch.device("cpu"))
    codes = rows.finish_codes(torch.tensor([0, token]), torch.tensor([0, n_before]), table.table).tolist()
    n = n_before + 1
    if n >= stop.max_new_tokens:
        expect = LENGTH
    elif n >= stop.min_new_tokens and token in stop.stop_ids:
        expect = STOP_TOKEN
    elif n >= stop.min_new_tokens:
        expect = TAIL_DECODE if stop.may_match_after(token, n) else TAIL_SKIP
    else:
        expect = RUNNING
    assert codes == [RUNNING, expect]
    # Without a table every checked row decodes.
    codes = rows.finish_codes(torch.tensor([0, token]), torch.tensor([0, n_before])).tolist()
    assert codes == [RUNNING, TAIL_DECODE if expect == TAIL_SKIP else expect]


def test_stop_tokens_are_masked_under_min_new_tokens_only():
    rows = SamplingRows.build((0, 1, 2), [_spec(0, PARAMS[1]), _spec(1, PARAMS[1]), _spec(2, PARAMS[0])],
                              torch.device("cpu"))
    logits = torch.zeros(3, VOCAB)
    rows.mask_stop_ids(logits, torch.tensor([1, 2, 0]))  # row 0 is under min_new_tokens (2), row 1 reached it
    assert torch.isinf(logits[0]).nonzero().flatten().tolist() == [1, 3, 4, 7]  # EOS 1 and stop_token_ids
    assert not torch.isinf(logits[1:]).any()


def test_ignore_eos_ends_on_no_stop_id_and_min_new_tokens_still_masks_them():
    """SGLang's rules: under ignore_eos neither EOS nor stop_token_ids end an answer (Req.check_finished), while
    min_new_tokens masks both either way (its min_new_tokens penalizer)."""
    params = PARAMS[5]  # ignore_eos, stop_token_ids [2, 9], min_new_tokens 3; EOS 1
    assert StopChecker(params, eos_token_ids=[1]).stop_ids == frozenset()
    rows = SamplingRows.build((0, 1), [_spec(0, params), _spec(1, params)], torch.device("cpu"))
    logits = torch.zeros(2, VOCAB)
    rows.mask_stop_ids(logits, torch.tensor([2, 3]))  # row 0 is under min_new_tokens, row 1 reached it
    assert torch.isinf(logits[0]).nonzero().flatten().tolist() == [1, 2, 9] and not torch.isinf(logits[1]).any()
    for token in (1, 2, 9):
        assert rows.finish_codes(torch.tensor([token, token]), torch.tensor([2, 5])).tolist() == [RUNNING, RUNNING]
    assert rows.finish_codes(torch.tensor([2, 2]), torch.tensor([8, 9])).tolist() == [RUNNING, LENGTH]


@pytest.mark.parametrize("which", ["project", "word_level"])
def test_batched_tail_decode_equals_tokenizer_decode(which):
    if which == "project":
        from slime_dsa.data.tokenizer import build_tokenizer

        tokenizer = build_tokenizer()
    else:
        from benchmarks.engine_throughput import word_tokenizer

        tokenizer = word_tokenizer(300)
    r = random.Random(1)
    tails = [[r.randrange(min(len(tokenizer), 300)) for _ in range(r.randrange(0, 12))] for _ in range(50)]
    assert decode_tails(tokenizer, tails) == [tokenizer.decode(t, skip_special_tokens=False) for t in tails]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 3), min_size=1, max_size=5)), min_size=1, max_size=8))
def test_block_tables_updated_in_place_equal_tables_built_from_scratch(steps):
    """The decoder's host block table, extended row by row while the key stays (tables only grow then), or rebuilt
    when the key changes, equals a fresh build at every step."""
    from types import SimpleNamespace

    import numpy as np

    from rollout.engine.decode import PagedDecoder

    decoder = PagedDecoder.__new__(PagedDecoder)
    decoder.cache, decoder._tables = SimpleNamespace(scratch_block=99), None
    reference = PagedDecoder.__new__(PagedDecoder)
    reference.cache, reference._tables = decoder.cache, None
    tables, key, next_block = None, 0, 0
    for same_key, growth in steps:
        if tables is None or not same_key or len(growth) != len(tables):
            key += 1
            tables = [[] for _ in growth]
        for table, grow in zip(tables, growth):
            table += list(range(next_block, next_block + grow))
            next_block += grow
        if not any(tables):
            tables[0].append(next_block)
            next_block += 1
        width = 1 << (max(map(len, tables)) - 1).bit_length()
        got = decoder._block_table(tables, width, key).copy()
        assert np.array_equal(got, reference._block_table(tables, width, None))
        assert all(list(row[: len(t)]) == t and (row[len(t):] == 99).all() for row, t in zip(got, tables))
