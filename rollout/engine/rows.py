"""The sampling rows of a step as device tensors: sampling parameters, seeds, token limits and stop tokens.

Each request's part is computed once, when it arrives (`RowSpec`). The rows stay on the device from step to step:
a step with the same requests in the same order reuses them, and when requests leave or join, `SamplingRows.update`
keeps the rows still there (one index_select on the device) and uploads only the new ones. With them the device masks
stop tokens under min_new_tokens, draws the uniforms of the next steps in one batched call (served a column a step
while the rows only advance, leave or reorder), and finds the rows that finished by length or by a stop token
(`finish_codes`); the host reads the codes with the tokens, in the step's one transfer. Each of those is a few device
ops a step (replayed from a graph of their own after a graphed decode forward: sample_graph.py); per-row constants are
precomputed at upload to keep them few.
Stop strings need the text, so they stay on the host (stop.py), for the rows that have them only; the device says
which of those rows need their tail decoded this step (`TAIL_DECODE`: the new token may complete a stop string, by
the request's completer mask from stop_chars.py, kept on the device in `CompleterTable`), so the host loops over
those rows only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from rollout.engine.sampling import SamplingBatch, cached_arange, counter_uniforms
from rollout.engine.stop import StopChecker
from rollout.engine.types import SamplingParams

# finish_codes values. TAIL_SKIP / TAIL_DECODE: running, with stop strings and at least min_new_tokens, and the new
# token cannot / may complete a stop string (StopChecker.may_match_after).
RUNNING, LENGTH, STOP_TOKEN, TAIL_SKIP, TAIL_DECODE = 0, 1, 2, 3, 4
# RowSpec.flags bits
SAMPLED, SORTS, MIN_P, MASKS_STOP_IDS, STOP_STRINGS, GREEDY, STREAMS, SCALES = 1, 2, 4, 8, 16, 32, 64, 128
# RowSpec.ints columns
GREEDY_COL, TOP_K, SEED, MIN_NEW, MAX_NEW, COMPLETER, COMPLETER_ROW, TAIL_FROM, STOP_FROM = range(INT_COLUMNS := 9)
NEVER = 2**62  # TAIL_FROM of a row without stop strings: no output count reaches it
MAX_DRAW_SPAN = 64  # the most steps of uniforms drawn ahead (SamplingRows.uniforms)


@dataclass(frozen=True)
class RowSpec:
    """One request's row: what it puts into each tensor of SamplingRows, and flags saying which work it needs."""

    floats: tuple[float, float, float]  # temperature (1 on a greedy row), top_p, min_p
    # greedy, top_k (vocab size where unrestricted), seed, min_new, max_new, completer (CompleterTable row; -1: no
    # stop strings), completer row clamped to 0, the output count from which stop strings are checked (min_new; NEVER
    # without stop strings): the last two spare finish_codes a clamp and two masks per step; the output count from
    # which a stop id ends the answer (min_new; NEVER under ignore_eos, whose stop ids are only masked)
    ints: tuple[int, int, int, int, int, int, int, int, int]
    stop_ids: tuple[int, ...]  # those min_new_tokens masks when it is set (StopChecker.masked_ids), else those that stop
    flags: int


def row_spec(params: SamplingParams, stop: StopChecker, seed: int, vocab_size: int, stream: bool = False,
             completer: int = 0) -> RowSpec:
    """The row of a request with these sampling params, stop rules and int64 seed; `stream`: it wants every step's
    output; `completer`: the CompleterTable row of its stop strings' completer mask (0: every token may complete one)."""
    greedy = params.greedy
    top_k = vocab_size if params.top_k < 0 else min(params.top_k, vocab_size)
    stop_ids = stop.masked_ids if stop.min_new_tokens > 0 else stop.stop_ids
    flags = GREEDY if greedy else SAMPLED | (SORTS if top_k < vocab_size or params.top_p < 1.0 else 0) | (
        MIN_P if params.min_p > 0 else 0) | (SCALES if float(params.temperature) != 1.0 else 0)
    flags |= (MASKS_STOP_IDS if stop.min_new_tokens > 0 and stop_ids else 0) | (
        STOP_STRINGS if stop.stop_strings else 0) | (STREAMS if stream else 0)
    return RowSpec(floats=(1.0 if greedy else float(params.temperature), float(params.top_p), float(params.min_p)),
                   ints=(int(greedy), top_k, seed, stop.min_new_tokens, stop.max_new_tokens,
                         completer if stop.stop_strings else -1, max(completer, 0) if stop.stop_strings else 0,
                         stop.min_new_tokens if stop.stop_strings else NEVER,
                         NEVER if params.ignore_eos else stop.min_new_tokens),
                   stop_ids=tuple(sorted(stop_ids)), flags=flags)


@dataclass
class SamplingRows:
    """B rows, each one request that samples a token this step."""

    key: tuple[int, ...]  # the requests' serial numbers, in row order
    floats: torch.Tensor  # (B, 3) float32: RowSpec.floats
    ints: torch.Tensor  # (B, 9) int64: RowSpec.ints
    stop_ids: torch.Tensor  # (B, S) int64, padded with the row's first stop id (-1 if none); S may be 0
    flags: int  # RowSpec.flags of all rows, or-ed
    string_rows: list[int]  # rows whose requests have stop strings
    stream_rows: list[int]  # rows whose requests stream (an output every step)
    row_flags: np.ndarray  # (B,) int64: RowSpec.flags of each row
    # Uniforms drawn ahead for these rows (B, span): column j for the output counts of the draw plus j; the next column.
    _draws: torch.Tensor | None = None
    _next_draw: int = 0

    @classmethod
    def build(cls, key: tuple[int, ...], specs: list[RowSpec], device: torch.device) -> "SamplingRows":
        """Rows from scratch: three uploads."""
        width = max((len(s.stop_ids) for s in specs), default=0)
        # Padding repeats a real entry, so the masking scatter never writes two values to one place.
        stop_ids = [s.stop_ids + s.stop_ids[:1] * (width - len(s.stop_ids)) if s.stop_ids else (-1,) * width
                    for s in specs]
        floats = torch.tensor([s.floats for s in specs], dtype=torch.float32).view(len(specs), 3)
        ints = torch.tensor([s.ints for s in specs], dtype=torch.long).view(len(specs), INT_COLUMNS)
        return cls._of(key, np.fromiter((s.flags for s in specs), dtype=np.int64, count=len(specs)), upload(floats, device),
                       upload(ints, device), upload(torch.tensor(stop_ids, dtype=torch.long).view(len(specs), width), device))

    @classmethod
    def _of(cls, key, row_flags: np.ndarray, floats, ints, stop_ids) -> "SamplingRows":
        return cls(key=key, floats=floats, ints=ints, stop_ids=stop_ids, flags=int(np.bitwise_or.reduce(row_flags, initial=0)),
                   string_rows=np.flatnonzero(row_flags & STOP_STRINGS).tolist(),
                   stream_rows=np.flatnonzero(row_flags & STREAMS).tolist(), row_flags=row_flags)

    def update(self, key: tuple[int, ...], specs: list[RowSpec], index: np.ndarray | None = None) -> "SamplingRows":
        """The rows of `key` (RowSpec each): these rows where the keys match, else rows kept from this step's (on the
        device) and new ones uploaded for requests not here. `index`: each key's row here (-1: not here), if known;
        given and without new rows, the rows keep their uniforms drawn ahead (`uniforms(..., follows=True)` goes on)."""
        if key == self.key:
            return self
        keeps_draws = index is not None and self._draws is not None and bool((index >= 0).all())
        if index is None:
            where = dict(zip(self.key, range(len(self.key))))
            index = np.fromiter((where.get(serial, -1) for serial in key), dtype=np.int64, count=len(key))
        else:
            index = index.copy()
        fresh_rows = np.flatnonzero(index < 0)
        index[fresh_rows] = np.arange(len(self.key), len(self.key) + len(fresh_rows))
        floats, ints, stop_ids, row_flags = self.floats, self.ints, self.stop_ids, self.row_flags
        if len(fresh_rows):
            new = SamplingRows.build((), [specs[i] for i in fresh_rows.tolist()], floats.device)
            width = max(stop_ids.shape[1], new.stop_ids.shape[1])
            floats, ints = torch.cat([floats, new.floats]), torch.cat([ints, new.ints])
            stop_ids = torch.cat([_widen(stop_ids, width), _widen(new.stop_ids, width)])
            row_flags = np.concatenate([row_flags, new.row_flags])
        picked = upload(torch.from_numpy(index), floats.device)
        rows = self._of(key, row_flags[index], floats[picked], ints[picked], stop_ids[picked])
        if keeps_draws:
            rows._draws, rows._next_draw = self._draws[picked], self._next_draw
        return rows

    def drop_draws(self) -> None:
        """Forget the uniforms drawn ahead (a step drew its own): the next `uniforms` call hashes afresh."""
        self._draws = None

    @functools.cached_property
    def columns(self) -> tuple[torch.Tensor, ...]:
        """The (B,) columns of `ints`, views made once per rows."""
        return self.ints.unbind(1)

    @functools.cached_property
    def sampling(self) -> SamplingBatch:
        """The rows' sampling parameters, made once per rows (the greedy mask is a cast)."""
        return SamplingBatch(
            temperature=self.floats[:, 0], top_p=self.floats[:, 1], min_p=self.floats[:, 2],
            greedy=self.ints[:, GREEDY_COL].bool(), top_k=self.ints[:, TOP_K],
            all_greedy=not self.flags & SAMPLED, any_greedy=bool(self.flags & GREEDY), needs_sort=bool(self.flags & SORTS),
            needs_min_p=bool(self.flags & MIN_P), scales=bool(self.flags & SCALES),
        )

    def mask_stop_ids(self, logits: torch.Tensor, num_output: torch.Tensor) -> None:
        """Stop tokens of rows still under min_new_tokens -> -inf, in place. num_output (B,) before this token."""
        if not self.flags & MASKS_STOP_IDS:
            return
        ids = self.stop_ids.clamp(min=0)  # (B, S)
        masked = (num_output < self.columns[MIN_NEW])[:, None] & (self.stop_ids >= 0)
        logits.scatter_(1, ids, torch.where(masked, float("-inf"), logits.gather(1, ids)))

    def uniforms(self, num_output: torch.Tensor, follows: bool = False,
                 dtype: torch.dtype = torch.float64) -> torch.Tensor | None:
        """The step's uniforms: one per row from its seed and the index of the token it samples, as `dtype`; None if
        greedy. `follows`: num_output is the last call's plus one on every row. Such calls are served from a block of
        draws made ahead (1, 2, 4, ... up to MAX_DRAW_SPAN steps), one column each: the hash runs once per block."""
        if not self.flags & SAMPLED:
            return None
        draws = self._draws
        if follows and draws is not None and draws.dtype == dtype and self._next_draw < draws.shape[1]:
            self._next_draw += 1
            return draws[:, self._next_draw - 1]
        span = min(2 * draws.shape[1], MAX_DRAW_SPAN) if follows and draws is not None else 1
        counters = num_output[:, None] + cached_arange(span, num_output.device) if span > 1 else num_output[:, None]
        self._draws = counter_uniforms(self.ints[:, SEED, None], counters).to(dtype)  # (B, span)
        self._next_draw = 1
        return self._draws[:, 0]

    def finish_codes(self, tokens: torch.Tensor, num_output: torch.Tensor, completers: torch.Tensor | None = None,
                     count: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) int64: LENGTH where this token reaches the limit, else STOP_TOKEN where it is a stop token and the
        output is at least min_new_tokens long, else RUNNING. StopChecker.check's order, on the device. A running row
        with stop strings and at least min_new_tokens gets TAIL_DECODE when its tail must be decoded (the first check,
        or a token its completer row in `completers` (CompleterTable.table) flags; every token without a table), else
        TAIL_SKIP. `count`: num_output + 1, if the caller has it on the device already."""
        count = num_output + 1 if count is None else count
        code = RUNNING  # the codes by rising priority: tail codes, then a stop token, then the length
        if self.flags & STOP_STRINGS:
            tail_from = self.columns[TAIL_FROM]
            if completers is None:
                tail = TAIL_DECODE
            else:  # the first check always decodes (count == tail_from), later ones where the completer mask says
                tail = ((count == tail_from) | completers[self.columns[COMPLETER_ROW], tokens]) + TAIL_SKIP
            code = torch.where(count >= tail_from, tail, code)
        if self.stop_ids.shape[1]:
            hit = (tokens[:, None] == self.stop_ids).any(dim=1)
            if self.flags & MASKS_STOP_IDS:  # else every row with stop ids stops on them from its first token
                hit &= count >= self.columns[STOP_FROM]
            code = torch.where(hit, STOP_TOKEN, code)
        return torch.where(count >= self.columns[MAX_NEW], LENGTH, code)


class CompleterTable:
    """The completer masks of an engine's requests (stop_chars.StopCompleters.mask) as rows of one (M, vocab) bool
    tensor on the device; row 0 flags every token (a mask of None, or more distinct masks than MAX_ROWS)."""

    MAX_ROWS = 64

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.table = torch.ones((1, vocab_size), dtype=torch.bool, device=device)
        self._rows: dict[bytes, int] = {}

    def row(self, mask: bytes | None) -> int:
        """The row of `mask` (mask[id] == 1: token id may complete a stop string; ids past it may too), added on
        first sight."""
        if mask is None:
            return 0
        row = self._rows.get(mask)
        if row is None:
            if len(self._rows) + 1 >= self.MAX_ROWS:
                return 0  # decoding every tail is always exact
            flags = torch.ones(self.vocab_size, dtype=torch.bool)
            n = min(len(mask), self.vocab_size)
            if n:
                flags[:n] = torch.frombuffer(bytearray(mask[:n]), dtype=torch.uint8).bool()
            self.table = torch.cat([self.table, flags.to(self.table.device)[None]])
            row = self._rows[mask] = len(self._rows) + 1
        return row


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device without waiting for it: pinned first on CUDA (a pageable copy waits for the stream)."""
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _widen(stop_ids: torch.Tensor, width: int) -> torch.Tensor:
    """(B, S) -> (B, width) by repeating each row's first entry (-1 where S is 0)."""
    if stop_ids.shape[1] == width:
        return stop_ids
    if stop_ids.shape[1] == 0:
        return stop_ids.new_full((stop_ids.shape[0], width), -1)
    return torch.cat([stop_ids, stop_ids[:, :1].expand(-1, width - stop_ids.shape[1])], dim=1)
