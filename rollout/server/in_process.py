"""EngineClient's generate and generate_batch over an embedded engine in this process, for a process with no server
(SFT's evaluation). A request takes the server's path without HTTP: the same /generate body, parsed and answered
by the same code, so group generation cannot tell the two apart.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from typing import Any

from rollout.client import EngineRequestError, EngineUnavailableError, add_generate_options
from rollout.engine.async_engine import AsyncEngine, EngineStoppedError
from rollout.engine.types import RequestError
from rollout.server import protocol
from rollout.server.app import run_all

WHERE = "in-process engine"  # names the engine in errors, where EngineClient names a URL


class InProcessClient:
    """generate / generate_batch with EngineClient's signatures and SGLang's response dicts, over an AsyncEngine
    (started by the caller). timeout_s None waits as long as the engine takes."""

    def __init__(self, engine: AsyncEngine, tokenizer: Any = None) -> None:
        self.engine, self.tokenizer = engine, tokenizer

    async def generate(self, input_ids: Sequence[int], sampling_params: dict | None = None, *,
                       return_logprob: bool = True, session_id: str | None = None, return_indexer_topk: bool = False,
                       indexer_topk_start_len: int = -1, rid: str | None = None,
                       timeout_s: float | None = None) -> dict:
        """One prompt's response dict (a list of n of them when sampling_params asks for n > 1, as SGLang)."""
        payload = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params or {}),
                   "return_logprob": return_logprob, "rid": rid or uuid.uuid4().hex}
        add_generate_options(payload, session_id, return_indexer_topk, indexer_topk_start_len)
        results, is_batch = await self._generate(payload, timeout_s)
        return results if is_batch else results[0]

    async def generate_batch(self, prompts: Sequence[Sequence[int]], sampling_params: Sequence[dict], *,
                             return_logprob: bool = True, session_id: str | None = None,
                             return_indexer_topk: bool = False, indexer_topk_start_len: int = -1,
                             timeout_s: float | None = None) -> list[dict]:
        """A batch of prompts, one sampling_params dict each; the results in order."""
        if not prompts or len(prompts) != len(sampling_params):
            raise ValueError(f"need one sampling_params per prompt, got {len(prompts)} prompts and "
                             f"{len(sampling_params)} sampling_params")
        payload = {"input_ids": [list(p) for p in prompts], "sampling_params": [dict(sp) for sp in sampling_params],
                   "return_logprob": return_logprob, "rid": [uuid.uuid4().hex for _ in prompts]}
        add_generate_options(payload, session_id, return_indexer_topk, indexer_topk_start_len)
        results, _ = await self._generate(payload, timeout_s)
        return results

    async def _generate(self, payload: dict, timeout_s: float | None) -> tuple[list[dict], bool]:
        """(one response dict per generation, whether the body asked for a batch); errors as EngineClient's."""
        start = time.perf_counter()
        engine = self.engine.engine
        try:
            call = protocol.parse_generate(payload, tokenizer=self.tokenizer, vocab_size=engine.config.vocab_size)
            outputs = await asyncio.wait_for(run_all(self.engine, call.requests), timeout_s)
        except RequestError as e:
            raise EngineRequestError(WHERE, 400, str(e)) from None
        except EngineStoppedError as e:
            raise EngineUnavailableError(f"{WHERE}: {e}") from None
        latency = time.perf_counter() - start
        with protocol.collector_paused():
            return [protocol.build_response(out, req, tokenizer=self.tokenizer, e2e_latency=latency)
                    for out, req in zip(outputs, call.requests)], call.is_batch
