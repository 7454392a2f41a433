"""The typed boundary between the embedded engine and everything that talks to it (server, actors, tests).

Field names follow SGLang's native protocol (shared/SGLANG_PROTOCOL.md), so the server maps them one to one.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any


class RequestError(ValueError):
    """A request field is invalid; the message names the field. The server turns it into HTTP 400."""


@dataclass
class SamplingParams:
    """SGLang's sampling_params. temperature < 1e-6 means greedy."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = whole vocabulary
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise RequestError naming the first invalid field."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise RequestError(f"sampling_params.max_new_tokens must be a non-negative integer, got {self.max_new_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise RequestError(f"sampling_params.temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"sampling_params.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise RequestError(f"sampling_params.top_k must be -1 or a positive integer, got {self.top_k!r}")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise RequestError(f"sampling_params.min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.min_new_tokens, int) or self.min_new_tokens < 0:
            raise RequestError(f"sampling_params.min_new_tokens must be a non-negative integer, got {self.min_new_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("sampling_params.stop must be a string or a list of non-empty strings")
        for tok in self.stop_token_ids:
            if not isinstance(tok, int) or tok < 0 or (vocab_size is not None and tok >= vocab_size):
                raise RequestError(f"sampling_params.stop_token_ids holds {tok!r}, not a token id in [0, {vocab_size})")
        if self.sampling_seed is not None and (not isinstance(self.sampling_seed, int)
                                               or not -2**63 <= self.sampling_seed < 2**64):
            raise RequestError(f"sampling_params.sampling_seed must be an integer in [-2**63, 2**64) (a torch "
                               f"generator seed), got {self.sampling_seed!r}")
        return self


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class GenerateRequest:
    """One generation: token ids in, token ids out."""

    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    return_logprob: bool = False
    return_indexer_topk: bool = False  # index replay: the top-k each full layer selected per generated token
    # First sequence row of the returned top-k: -1 = the rows that produced output tokens (from P-1); >= 0 = from
    # that row on, prompt rows included (rows below index_topk are left out: they select every causal key).
    indexer_topk_start_len: int = -1
    session_id: str | None = None  # multi-turn affinity / prefix reuse hint
    stream: bool = True  # False: the engine emits only the final output (no per-step copies of the state)
    # Prefill-only scoring (sampling.max_new_tokens 0, return_logprob): the log-probs of input tokens
    # logprob_start_len .. P-1 (SGLang's input_token_logprobs; the first is None), each row's top_logprobs_num
    # likeliest ids, under softmax(logits / input_logprob_temperature).
    logprob_start_len: int = -1  # -1 = no input log-probs
    top_logprobs_num: int = 0
    input_logprob_temperature: float = 1.0

    @property
    def scores_input(self) -> bool:
        """Whether this request is prefill-only scoring: input log-probs and no generation."""
        return (self.return_logprob and 0 <= self.logprob_start_len < len(self.input_ids)
                and self.sampling.max_new_tokens == 0)


@dataclass
class GenerateOutput:
    """The state of a request so far (cumulative, as SGLang streams it). finish_reason None until done.

    finish_reason: {"type": "stop", "matched": id|str} | {"type": "length", "length": n} | {"type": "abort", "message": s}
    """

    rid: str
    output_ids: list[int]
    output_token_logprobs: list[float]  # log-prob of each output token under the distribution it was sampled from
    output_token_versions: list[int]  # weight version that produced each output token
    finish_reason: dict | None
    prompt_tokens: int
    cached_tokens: int = 0
    weight_version: str = "0"
    indexer_topk: Any = None  # int32 array (rows, n_full_layers, index_topk), -1 padded; None unless asked (final
    # output only). Row j is the selection of sequence row indexer_topk_start + j; row p produced token p + 1.
    indexer_topk_start: int | None = None  # P - 1 unless the request set indexer_topk_start_len >= 0
    input_token_logprobs: list[float | None] | None = None  # scoring: one per input token from logprob_start_len
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None  # scoring: (logprob, id) pairs per token
