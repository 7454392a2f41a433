"""How the Triton indexer (triton_indexer.py) splits packed query rows into launches: pure index arithmetic on the
host, in numpy, so a batch of a thousand short sequences costs no Python loop over its sequences or blocks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np


def plan_chunks(cu_q: Sequence[int], cu_k: Sequence[int], topk: int, block_m: int,
                chunk_elems: int) -> Iterator[tuple[int, int, int, np.ndarray]]:
    """Split the packed query rows into chunks of at most `chunk_elems` scores.

    Yields (first row, end row, width, blocks): blocks (4, n) int32, a column per block of up to `block_m`
    consecutive queries of one sequence: its first query row, its query count, the row of the sequence's key 0 and
    the causal position of its first query. A sequence is cut into pieces of whole blocks that fit a chunk; chunks
    hold consecutive pieces, greedily, and may span sequences (many short decode requests share one launch).
    """
    cq, ck = np.asarray(cu_q, dtype=np.int64), np.asarray(cu_k, dtype=np.int64)
    lq, lk = np.diff(cq), np.diff(ck)
    over = np.flatnonzero(lq > lk)
    if over.size:
        i = int(over[0])
        raise ValueError(f"indexer_topk: sequence {i} has more queries ({lq[i]}) than keys ({lk[i]})")
    step = np.maximum(block_m, (chunk_elems // np.maximum(lk, topk)) // block_m * block_m)  # rows per piece
    pieces_per_seq = -(-lq // step)
    seq = np.repeat(np.arange(len(lq)), pieces_per_seq)  # (P,) each piece's sequence
    a = _index_within(pieces_per_seq) * step[seq]
    b = np.minimum(a + step[seq], lq[seq])
    start, end = cq[seq] + a, cq[seq] + b  # (P,) the piece's rows
    width = np.maximum(lk[seq] - lq[seq] + b, topk)  # (P,) keys its last query sees, at least topk
    first = 0
    while first < len(seq):
        widths = np.maximum.accumulate(width[first:])  # a chunk's width if it ended at each piece
        too_big = (end[first:] - start[first]) * widths > chunk_elems
        too_big[0] = False  # a chunk holds at least one piece
        stop = first + int(np.argmax(too_big)) if too_big.any() else len(seq)
        yield int(start[first]), int(end[stop - 1]), int(widths[stop - 1 - first]), _blocks(
            start[first:stop], end[first:stop], seq[first:stop], cq, ck, block_m)
        first = stop


def _index_within(counts: np.ndarray) -> np.ndarray:
    """0, 1, .., counts[0]-1, 0, 1, .., counts[1]-1, ...: each item's index within its group."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def _blocks(start: np.ndarray, end: np.ndarray, seq: np.ndarray, cq: np.ndarray, ck: np.ndarray,
            block_m: int) -> np.ndarray:
    """The (4, n) int32 blocks of the pieces [start, end) of sequences `seq`."""
    per_piece = -(-(end - start) // block_m)
    rows = np.repeat(start, per_piece) + _index_within(per_piece) * block_m
    counts = np.minimum(block_m, np.repeat(end, per_piece) - rows)
    s = np.repeat(seq, per_piece)
    position = (ck[s + 1] - ck[s]) - (cq[s + 1] - cq[s]) - cq[s] + rows  # a query's position is its row + this
    return np.stack([rows, counts, ck[s], position]).astype(np.int32)
