"""The shared-prompt layout built by tensor ops (slime_dsa/models/prefix_sharing.py) equals, element for element, the
per-token loops it replaced (kept here as the reference), on random batches: runs of samples sharing a prompt,
equal-length prompts that differ, empty responses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_dsa.models.prefix_sharing import concat_ranges, pack_shared_prefixes, shared_prompt_lengths


def _reference_shared(flat: list[int], seqlens: list[int], prompt_lens: list[int]) -> list[int]:
    out, start, prev = [], 0, None
    for n, p in zip(seqlens, prompt_lens):
        same = prev is not None and prev[1] == p and flat[prev[0]:prev[0] + p] == flat[start:start + p]
        out.append(p if same else 0)
        prev, start = (start, p), start + n
    return out


def _reference_pack(flat: list[int], seqlens: list[int], prompt_lens: list[int]) -> dict[str, list[int]] | None:
    starts = [0]
    for n in seqlens:
        starts.append(starts[-1] + n)
    groups: list[list[int]] = []
    for i, shared in enumerate(_reference_shared(flat, seqlens, prompt_lens)):
        if shared:
            groups[-1].append(i)
        else:
            groups.append([i])
    if all(len(g) == 1 for g in groups):
        return None
    ids, positions, lens_q, lens_k, key_rows = [], [], [], [], []
    source = [0] * starts[-1]
    for group in groups:
        p = prompt_lens[group[0]]
        prompt_row = len(ids)
        ids += flat[starts[group[0]]:starts[group[0]] + p]
        positions += range(p)
        lens_q.append(p)
        lens_k.append(p)
        key_rows += range(prompt_row, prompt_row + p)
        for i in group:
            source[starts[i]:starts[i] + p] = range(prompt_row, prompt_row + p)
            r = seqlens[i] - p
            if r == 0:
                continue
            row = len(ids)
            ids += flat[starts[i] + p:starts[i + 1]]
            positions += range(p, p + r)
            lens_q.append(r)
            lens_k.append(p + r)
            key_rows += list(range(prompt_row, prompt_row + p)) + list(range(row, row + r))
            source[starts[i] + p:starts[i + 1]] = range(row, row + r)
    response_index = [t for i in range(len(seqlens)) for t in range(starts[i] + prompt_lens[i], starts[i + 1])]
    cumsum = lambda x: [sum(x[:k]) for k in range(len(x) + 1)]  # noqa: E731
    return {"input_ids": ids, "positions": positions, "cu_q": cumsum(lens_q), "cu_k": cumsum(lens_k),
            "key_rows": key_rows, "response_index": response_index,
            "response_rows": [source[t - 1] for t in response_index]}


@st.composite
def _batches(draw):
    """Groups of samples: each group one prompt (sometimes a near-copy of the previous one: same length, one token
    changed), responses of 0..5 tokens; vocabulary 3 so that prompts also collide by chance."""
    flat, seqlens, plens, prompt = [], [], [], None
    for _ in range(draw(st.integers(1, 6))):
        if prompt is not None and draw(st.booleans()):
            prompt = list(prompt)
            prompt[draw(st.integers(0, len(prompt) - 1))] += 1
        else:
            prompt = draw(st.lists(st.integers(0, 2), min_size=1, max_size=5))
        for _ in range(draw(st.integers(1, 4))):
            response = draw(st.lists(st.integers(0, 2), max_size=5))
            flat += prompt + response
            seqlens.append(len(prompt) + len(response))
            plens.append(len(prompt))
    return flat, seqlens, plens


@settings(max_examples=300, deadline=None)
@given(_batches())
def test_tensor_built_layout_equals_the_per_token_loops(batch):
    flat, seqlens, plens = batch
    assert shared_prompt_lengths(torch.tensor(flat), seqlens, plens) == _reference_shared(flat, seqlens, plens)
    assert shared_prompt_lengths(flat, seqlens, plens) == _reference_shared(flat, seqlens, plens)
    pack, expected = pack_shared_prefixes(torch.tensor(flat), seqlens, plens), _reference_pack(flat, seqlens, plens)
    assert (pack is None) == (expected is None)
    if pack is None:
        return
    got = {"input_ids": pack.input_ids, "positions": pack.batch.positions, "cu_q": pack.batch.cu_seqlens_q,
           "cu_k": pack.batch.cu_seqlens_k, "key_rows": pack.batch.kv_cache.key_rows,
           "response_index": pack.response_index, "response_rows": pack.response_rows}
    for key, value in got.items():
        assert value.dtype == torch.long and value.tolist() == expected[key], key


def test_concat_ranges():
    assert concat_ranges(np.array([5, 0, 2]), np.array([2, 0, 3])).tolist() == [5, 6, 2, 3, 4]
    assert concat_ranges(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)).tolist() == []


def test_invalid_prompt_lengths_are_refused_by_both():
    for bad in ([0, 2], [3, 2], [1]):
        for build in (shared_prompt_lengths, pack_shared_prefixes):
            with pytest.raises(ValueError, match="prompt_lens"):
                build(torch.arange(5), [2, 3], bad)
