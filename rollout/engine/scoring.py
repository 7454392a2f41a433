"""Prefill-only scoring: the log-probs of a request's own input tokens, SGLang's `input_token_logprobs`.

A teacher scores a student's sample this way: /generate with the sample's ids, max_new_tokens 0, return_logprob and
logprob_start_len. One packed forward without KV cache covers a batch of such requests; row p of a sequence yields
the distribution over token p + 1, so token j's log-prob comes from row j - 1. As in SGLang, the entries cover
tokens logprob_start_len .. P-1 and the first is None (its row is not computed). Top log-probs (top_logprobs_num)
come from the same rows. The distribution is softmax(logits / input_logprob_temperature): SGLang scores at
temperature 1 unless told (its input_logprob_temperature field), and a teacher must score at the rollout's.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict, deque
from dataclasses import dataclass

import torch

from rollout.engine.types import GenerateOutput, GenerateRequest, RequestError
from slime_dsa.devices import upload
from slime_dsa.models import GlmMoeDsaForCausalLM, PackedBatch
from slime_dsa.models.logprobs import chunked_logprobs

logger = logging.getLogger(__name__)


@dataclass
class InputScores:
    """One request's scores: log-probs of tokens logprob_start_len .. P-1 (the first None) and, with
    top_logprobs_num, the (logprob, id) pairs of each of those rows (the first None)."""

    token_logprobs: list[float | None]
    top_logprobs: list[list[tuple[float, int]] | None] | None = None


@torch.inference_mode()
def score_requests(model: GlmMoeDsaForCausalLM, requests: list[GenerateRequest],
                   chunk_size: int = 1024) -> list[InputScores]:
    """The input scores of each prefill-only request, from one packed forward over all of them."""
    device = model.device
    lens = [len(r.input_ids) for r in requests]
    ids = upload(torch.tensor([t for r in requests for t in r.input_ids], dtype=torch.long), device)
    hidden = model.forward_packed(ids, PackedBatch.from_seqlens(lens, device), return_logits=False).hidden_states
    # rows L .. P-2 of each sequence give tokens L+1 .. P-1; requests with the same temperature and k go together
    starts = [sum(lens[:i]) for i in range(len(lens))]
    rows_of = [torch.arange(s + r.logprob_start_len, s + n - 1, device=device)
               for r, s, n in zip(requests, starts, lens)]
    groups: dict[tuple[float, int], list[int]] = defaultdict(list)
    for i, r in enumerate(requests):
        groups[(float(r.input_logprob_temperature), int(r.top_logprobs_num))].append(i)
    results: list[InputScores | None] = [None] * len(requests)
    for (temperature, top_k), members in groups.items():
        rows = torch.cat([rows_of[i] for i in members])
        res = chunked_logprobs(hidden.index_select(0, rows), model.lm_head.weight, ids.index_select(0, rows + 1),
                               temperature, chunk_size, top_k=top_k)
        logps = res.logprobs.double().tolist()
        top = (res.topk_logprobs.double().tolist(), res.topk_ids.tolist()) if top_k else None
        offset = 0
        for i in members:
            n = len(rows_of[i])
            scores = InputScores([None, *logps[offset:offset + n]])
            if top is not None:
                values, ids_ = top
                scores.top_logprobs = [None] + [list(zip(values[j], ids_[j])) for j in range(offset, offset + n)]
            results[i] = scores
            offset += n
    return results  # type: ignore[return-value]


class ScoringQueue:
    """An engine's prefill-only requests: checked when added, scored in batches of at most max_tokens input tokens
    (at least one request) by `step`, which the engine calls first in each of its steps."""

    def __init__(self, model: GlmMoeDsaForCausalLM, max_tokens: int) -> None:
        self.model, self.max_tokens = model, max_tokens
        self._queue: deque[GenerateRequest] = deque()

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, req: GenerateRequest) -> None:
        """Queue a scoring request; RequestError names the field it gets wrong."""
        config = self.model.config
        ids, vocab = req.input_ids, config.vocab_size
        if not isinstance(ids, (list, tuple)) or not ids:
            raise RequestError("input_ids must be a non-empty list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids) or min(ids) < 0 or max(ids) >= vocab:
            raise RequestError(f"input_ids must hold integer token ids in [0, {vocab})")
        req.sampling.validate(vocab)
        if len(ids) > config.max_position_embeddings:
            raise RequestError(f"input_ids has {len(ids)} tokens, the model's context (max_position_embeddings) is "
                               f"{config.max_position_embeddings}")
        if not 0 <= req.logprob_start_len < len(ids):
            raise RequestError(f"logprob_start_len ({req.logprob_start_len}) must be in [0, {len(ids)}) for "
                               f"{len(ids)} input tokens")
        if not 0 <= req.top_logprobs_num <= vocab:
            raise RequestError(f"top_logprobs_num ({req.top_logprobs_num}) must be in [0, {vocab}]")
        temperature = req.input_logprob_temperature
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
                math.isfinite(temperature) and temperature > 0):
            raise RequestError(f"input_logprob_temperature must be a finite number > 0, got {temperature!r}")
        if any(r.rid == req.rid for r in self._queue):
            raise RequestError(f"rid {req.rid!r} is already in use")
        self._queue.append(req)

    def abort(self, rid: str | None, abort_all: bool, reason: dict, weight_version: str) -> list[GenerateOutput]:
        """End the queued request `rid` (or all) with `reason`; their final outputs."""
        ended = [r for r in self._queue if abort_all or r.rid == rid]
        for req in ended:
            self._queue.remove(req)
        return [self._output(req, reason, weight_version) for req in ended]

    def step(self, weight_version: str, stats: dict[str, int]) -> list[GenerateOutput]:
        """Score the oldest requests in one forward; a failure ends that batch's requests (abort), not the engine."""
        batch, tokens = [], 0
        while self._queue and (not batch or tokens + len(self._queue[0].input_ids) <= self.max_tokens):
            batch.append(self._queue.popleft())
            tokens += len(batch[-1].input_ids)
        try:
            scores = score_requests(self.model, batch)
        except Exception as exc:  # noqa: BLE001 - one bad batch must not stop the engine
            logger.exception("engine: scoring %d requests failed", len(batch))
            reason = {"type": "abort", "message": f"engine error: {type(exc).__name__}: {exc}"}
            return [self._output(req, reason, weight_version) for req in batch]
        stats["scored_tokens"] = stats.get("scored_tokens", 0) + tokens
        done = {"type": "length", "length": 0}
        return [self._output(req, done, weight_version, s) for req, s in zip(batch, scores)]

    @staticmethod
    def _output(req: GenerateRequest, reason: dict, weight_version: str,
                scores: InputScores | None = None) -> GenerateOutput:
        return GenerateOutput(
            rid=req.rid, output_ids=[], output_token_logprobs=[], output_token_versions=[], finish_reason=reason,
            prompt_tokens=len(req.input_ids), weight_version=weight_version,
            input_token_logprobs=None if scores is None else scores.token_logprobs,
            input_top_logprobs=None if scores is None else scores.top_logprobs)
