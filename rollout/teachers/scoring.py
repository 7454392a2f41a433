"""A teacher's prefill-only scoring request and its reply, in SGLang's /generate protocol.

Request: the samples' whole token ids (prompt + response) as a batch, sampling_params.max_new_tokens 0,
return_logprob, logprob_start_len P - 1 per sample (P its prompt length), top_logprobs_num k with the top-k option,
and input_logprob_temperature T (the rollout temperature: SGLang scores input tokens at temperature 1 unless a server
knows this field, sglang PR 36213; our embedded server does). The reply's meta_info.input_token_logprobs covers
tokens P-1 .. P+R-1, the first None: entries 1.. are the response tokens' log-probs; input_top_logprobs likewise.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout.client import MalformedResponseError

TEMPERATURE_FIELD = "input_logprob_temperature"


@dataclass
class TeacherScores:
    """A teacher's scores of one sample's response tokens."""

    logprobs: list[float]  # (R,) log π_T of each response token
    topk_ids: np.ndarray | None = None  # (R, k) int32: the teacher's k likeliest ids at each response position
    topk_logprobs: np.ndarray | None = None  # (R, k) float32: their log-probs

    @property
    def num_tokens(self) -> int:
        return len(self.logprobs)


def score_payload(sequences: list[list[int]], prompt_lens: list[int], temperature: float, top_k: int = 0) -> dict:
    """The /generate body that scores each sequence's tokens after its prompt (a batch, one entry per sequence)."""
    payload: dict[str, Any] = {
        "input_ids": [list(s) for s in sequences],
        "sampling_params": [{"max_new_tokens": 0, "temperature": temperature} for _ in sequences],
        "return_logprob": True, "logprob_start_len": [p - 1 for p in prompt_lens],
        TEMPERATURE_FIELD: temperature, "rid": [uuid.uuid4().hex for _ in sequences],
    }
    if top_k:
        payload["top_logprobs_num"] = top_k
    return payload


def parse_scores(body: Any, where: str, sequences: list[list[int]], prompt_lens: list[int], temperature: float,
                 top_k: int = 0, weight_version: str | None = None) -> list[TeacherScores]:
    """The scores of each sequence's response tokens from a /generate reply; MalformedResponseError names `where`
    (the teacher and its engine) and the field. weight_version: the version the engine must report (a swapped-in
    teacher), so that no sample is scored by another teacher's weights."""
    if not isinstance(body, list) or len(body) != len(sequences):
        raise MalformedResponseError(f"{where}: expected a list of {len(sequences)} results, got {str(body)[:120]!r}")
    return [_parse_one(item, f"{where}[{i}]", seq, p, temperature, top_k, weight_version)
            for i, (item, seq, p) in enumerate(zip(body, sequences, prompt_lens))]


def _parse_one(item: Any, where: str, sequence: list[int], prompt_len: int, temperature: float, top_k: int,
               weight_version: str | None) -> TeacherScores:
    meta = item.get("meta_info") if isinstance(item, dict) else None
    if not isinstance(meta, dict):
        raise MalformedResponseError(f"{where}: no meta_info object in the reply")
    if weight_version is not None and str(meta.get("weight_version")) != weight_version:
        raise MalformedResponseError(f"{where}: scored by weight_version {meta.get('weight_version')!r}, expected "
                                     f"{weight_version!r}")
    scaled = meta.get(TEMPERATURE_FIELD)
    if not math.isclose(temperature, 1.0) and (scaled is None or not math.isclose(float(scaled), temperature)):
        raise MalformedResponseError(
            f"{where}: scored at temperature {1.0 if scaled is None else scaled}, not the rollout's {temperature} (the "
            f"server ignores {TEMPERATURE_FIELD}; SGLang needs PR 36213): set rollout.temperature 1.0 or serve the "
            "teacher with a server that supports it")
    entries = meta.get("input_token_logprobs")
    expected = sequence[prompt_len - 1:]
    if not isinstance(entries, list) or len(entries) != len(expected):
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise MalformedResponseError(f"{where}: meta_info.input_token_logprobs has {got} entries, expected "
                                     f"{len(expected)} (tokens {prompt_len - 1} .. {len(sequence) - 1})")
    ids = [e[1] if isinstance(e, (list, tuple)) and len(e) >= 2 else None for e in entries]
    if ids != expected:
        raise MalformedResponseError(f"{where}: meta_info.input_token_logprobs holds other token ids than the sample's")
    logprobs = [e[0] for e in entries[1:]]
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in logprobs):
        raise MalformedResponseError(f"{where}: meta_info.input_token_logprobs holds a value that is not a finite "
                                     "number")
    scores = TeacherScores([float(x) for x in logprobs])
    if top_k:
        scores.topk_ids, scores.topk_logprobs = _parse_top(meta.get("input_top_logprobs"), where, len(logprobs), top_k)
    return scores


def _parse_top(rows: Any, where: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(rows, list) or len(rows) != n + 1:
        got = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise MalformedResponseError(f"{where}: meta_info.input_top_logprobs has {got} entries, expected {n + 1}")
    ids, values = np.zeros((n, k), dtype=np.int32), np.zeros((n, k), dtype=np.float32)
    for j, row in enumerate(rows[1:]):
        if not isinstance(row, list) or len(row) != k:
            raise MalformedResponseError(f"{where}: meta_info.input_top_logprobs[{j + 1}] holds "
                                         f"{len(row) if isinstance(row, list) else row!r} entries, expected {k}")
        try:
            values[j] = [float(e[0]) for e in row]
            ids[j] = [int(e[1]) for e in row]
        except (TypeError, ValueError, IndexError):
            raise MalformedResponseError(f"{where}: meta_info.input_top_logprobs[{j + 1}] is not a list of "
                                         "[logprob, token_id, text]") from None
    return ids, values
