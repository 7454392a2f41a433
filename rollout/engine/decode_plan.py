"""The running requests' decode rows carried from one step to the next, so that a step does not test every request.

A decode row (one new row, its block allocated, its last token not yet in flight) stays one for a number of steps
that its counters give: until its block fills, until its token limit. The plan keeps, per row, the step before which
that surely holds; a step re-checks only the rows that reach theirs (Engine._schedule). Requests that end leave the
plan with their rows; any other change of the running requests (an admission, a retract, a drain of the step in
flight) drops it, and the next step tests every request again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


def steady_steps(seq: Any, block_size: int) -> int:
    """Steps from this one on (this one counted) in which `seq` stays a plain decode row, if only decoding changes it:
    each step adds one row and one token; the tokens in flight stay as many; registered blocks and the block table
    only grow, which can only lengthen the span."""
    # Its token limit too: a row whose last token is in flight takes no step (Engine._schedule), and one that several
    # steps a launch (Engine.num_continuous_decode_steps) would take past its limit must be checked first. A block that
    # fills is offered to the prefix cache when the step that completes its tokens is read (Engine._resolve_step),
    # so block boundaries need no check.
    return min(len(seq.blocks) * block_size - seq.num_computed,
               seq.stop.max_new_tokens - (len(seq.tokens) - seq.prompt_len))


@dataclass(eq=False)
class DecodePlan:
    """The running sequences, in running order, all decode rows; `until[i]`: the step count before which row i needs
    no check."""

    rows: list[Any]
    until: np.ndarray
    next_check: int  # until.min()
    chainable: bool = False  # the engine may decode these rows several steps a launch (none streams, none wants
    # per-step replay rows); rows only leave a plan, so this stays true while it lasts

    @classmethod
    def build(cls, rows: list[Any], spans: list[int], step: int) -> "DecodePlan":
        """A plan for rows scheduled as decode rows at `step`, with their steady_steps at that step (before its
        launch); a row with none left is checked again at the next step."""
        until = step + np.maximum(np.asarray(spans, dtype=np.int64), 1)
        return cls(list(rows), until, int(until.min()) if len(until) else step + 1)

    def remove(self, positions: list[int]) -> None:
        """Leave out the rows at these positions (ascending): requests that ended."""
        for i in reversed(positions):
            del self.rows[i]
        self.until = np.delete(self.until, positions)
        self.refresh()

    def keep(self, mask: np.ndarray) -> None:
        """Keep the rows where `mask` is true."""
        self.rows = [seq for seq, kept in zip(self.rows, mask.tolist()) if kept]
        self.until = self.until[mask]
        self.refresh()

    def due(self, step: int) -> list[int]:
        """The rows to check at `step`."""
        return np.flatnonzero(self.until <= step).tolist() if step >= self.next_check else []

    def checked(self, row: int, step: int, block_size: int) -> None:
        """Row `row` was checked (and grown) at `step`: its span from there."""
        self.until[row] = step + max(steady_steps(self.rows[row], block_size), 1)

    def refresh(self) -> None:
        """next_check after rows changed."""
        self.next_check = int(self.until.min()) if len(self.until) else self.next_check
