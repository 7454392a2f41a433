"""A teacher served by engines of its own (embedded, SGLang or external): prefill-only scoring through one
EngineClient per teacher, so one teacher's queue (its engines' in-flight caps) never holds up another's.

A failed request is retried, counted in retried_samples: on another of the teacher's engines when one is healthy;
when none answers /health, after `recover` restarted the dead ones (engines the run started) or, for servers the run
does not own, once they answer again. A sample is given up on only after MAX_ATTEMPTS attempts or timeout_s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from rollout.client import EngineClient, EngineUnavailableError
from rollout.teachers.scoring import TeacherScores, parse_scores, score_payload
from rollout.teachers.stats import TeacherStats

logger = logging.getLogger(__name__)

Recover = Callable[[list[str]], Awaitable[list[str]]]  # dead engine URLs -> the URLs of their replacements
MAX_ATTEMPTS = 10
BACKOFF_S, MAX_BACKOFF_S = 0.5, 8.0


class TeacherUnavailableError(RuntimeError):
    """A teacher did not score a request after every retry; the message names the teacher."""


class DirectScorer:
    """Scores samples on the teacher's own engines (urls), retrying and restarting as the module says."""

    def __init__(self, name: str, urls: list[str], *, temperature: float, top_k: int = 0,
                 recover: Recover | None = None, timeout_s: float = 600.0, max_inflight_per_engine: int = 256,
                 api_key: str | None = None) -> None:
        self.name, self.temperature, self.top_k = name, temperature, top_k
        self.recover, self.timeout_s = recover, timeout_s
        # max_retries 0: every attempt comes back here, where it is counted
        self.client = EngineClient(urls, max_inflight_per_engine=max_inflight_per_engine, timeout_s=timeout_s,
                                   max_retries=0, api_key=api_key)
        self.stats = TeacherStats()
        self._recovering = asyncio.Lock()

    async def score(self, sequences: list[list[int]], prompt_lens: list[int]) -> list[TeacherScores]:
        """The teacher's scores of each sequence's tokens after its prompt (one batched request)."""
        deadline = time.monotonic() + self.timeout_s
        for attempt in range(1, MAX_ATTEMPTS + 1):
            payload = score_payload(sequences, prompt_lens, self.temperature, self.top_k)
            try:
                with self.stats.busy():
                    body, url = await self.client.request("/generate", payload, abort_rid=payload["rid"])
            except EngineUnavailableError as e:
                self.stats.retried_samples += len(sequences)
                if attempt == MAX_ATTEMPTS or time.monotonic() > deadline:
                    raise TeacherUnavailableError(f"teacher '{self.name}' failed {attempt} times: {e}") from None
                logger.info("teacher %s: attempt %d failed (%s); retrying", self.name, attempt, e)
                await self._recover()
                await asyncio.sleep(min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (attempt - 1)))
                continue
            scores = parse_scores(body, f"teacher '{self.name}' at {url}/generate", sequences, prompt_lens,
                                  self.temperature, self.top_k)
            self.stats.requests += 1
            self.stats.samples += len(sequences)
            self.stats.tokens += sum(len(s) for s in sequences)
            self.stats.response_tokens += sum(s.num_tokens for s in scores)
            return scores
        raise AssertionError("unreachable")

    async def _recover(self) -> None:
        """Restart the engines that do not answer /health (once, however many requests failed together)."""
        if self.recover is None:
            return
        async with self._recovering:
            dead = [url for url in list(self.client.engines) if not await self._alive(url)]
            if not dead:
                return
            logger.warning("teacher %s: restarting %d engine(s) that stopped answering: %s", self.name, len(dead), dead)
            for old, new in zip(dead, await self.recover(dead)):
                self.client.replace_engine(old, new)
            self.stats.restarts += len(dead)

    async def _alive(self, url: str) -> bool:
        try:
            return await self.client.get(url, "/health", timeout_s=5.0) is None
        except Exception:  # noqa: BLE001 - whatever the failure, it is not alive
            return False

    async def close(self) -> None:
        await self.client.close()
