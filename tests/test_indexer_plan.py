"""The Triton indexer's launch plan (slime_dsa/ops/indexer_plan.py) in numpy equals the per-sequence loop it
replaced, written out here as the reference, on packed batches of every kind: training (queries = keys), decode
(one query per sequence), shared prompts (responses whose keys start with their prompt's), empty sequences, and
chunk budgets small enough to cut sequences into pieces and batches into many chunks."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from slime_dsa.ops.indexer_plan import plan_chunks


def loop_plan(cu_q, cu_k, topk, block_m, chunk_elems):
    """The plan as the loop computed it (triton_indexer._plan_chunks before), blocks as (4, n)."""
    pieces = []
    for i in range(len(cu_q) - 1):
        lq, lk = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        step = max(block_m, (chunk_elems // max(lk, topk)) // block_m * block_m)
        for a in range(0, lq, step):
            b = min(a + step, lq)
            pieces.append((cu_q[i] + a, cu_q[i] + b, lk - lq + b, i))

    def emit(chunk, width):
        blocks = []
        for r0, r1, _, i in chunk:
            first_pos = (cu_k[i + 1] - cu_k[i]) - (cu_q[i + 1] - cu_q[i]) - cu_q[i]
            for r in range(r0, r1, block_m):
                blocks.append((r, min(block_m, r1 - r), cu_k[i], first_pos + r))
        return chunk[0][0], chunk[-1][1], width, np.array(blocks, dtype=np.int32).reshape(-1, 4).T

    out, chunk, width = [], [], 0
    for piece in pieces:
        new_width = max(width, piece[2], topk)
        if chunk and (piece[1] - chunk[0][0]) * new_width > chunk_elems:
            out.append(emit(chunk, width))
            chunk, new_width = [], max(piece[2], topk)
        chunk.append(piece)
        width = new_width
    if chunk:
        out.append(emit(chunk, width))
    return out


def _batch(rng: random.Random, kind: str) -> tuple[list[int], list[int]]:
    lens_q, lens_k = [], []
    for _ in range(rng.randint(1, 40)):
        if kind == "train":
            n = rng.choice([0, 1, rng.randint(2, 50), rng.randint(100, 700)])
            lens_q.append(n)
            lens_k.append(n)
        elif kind == "decode":
            lens_q.append(1)
            lens_k.append(rng.randint(1, 900))
        else:  # shared prompts: a prompt sequence, then responses that see it first
            prompt = rng.randint(1, 120)
            lens_q.append(prompt)
            lens_k.append(prompt)
            for _ in range(rng.randint(1, 8)):
                answer = rng.randint(0, 60)
                lens_q.append(answer)
                lens_k.append(prompt + answer)
    return list(itertools.accumulate(lens_q, initial=0)), list(itertools.accumulate(lens_k, initial=0))


@pytest.mark.parametrize("kind", ["train", "decode", "shared"])
def test_the_numpy_plan_is_the_loops(kind):
    rng = random.Random(kind)
    for _ in range(60):
        cu_q, cu_k = _batch(rng, kind)
        topk, block_m = rng.choice([4, 16, 256]), rng.choice([1, 2, 8, 16])
        chunk_elems = rng.choice([1 << 10, 1 << 14, 1 << 28])
        got = list(plan_chunks(cu_q, cu_k, topk, block_m, chunk_elems))
        want = loop_plan(cu_q, cu_k, topk, block_m, chunk_elems)
        assert [g[:3] for g in got] == [w[:3] for w in want]
        for g, w in zip(got, want):
            assert g[3].dtype == np.int32 and g[3].shape == w[3].shape and np.array_equal(g[3], w[3])


def test_more_queries_than_keys_is_named():
    with pytest.raises(ValueError, match=r"sequence 1 has more queries \(5\) than keys \(3\)"):
        list(plan_chunks([0, 2, 7], [0, 2, 5], 4, 8, 1 << 20))
