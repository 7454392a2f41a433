"""Teachers that outnumber devices: one engine per swap group holds one teacher at a time; the others wait in pinned
CPU memory inside the engine's process (the embedded server's preloaded weights) and are copied in when their turn
comes, through SGLang's /update_weights_from_disk with the teacher's checkpoint path.

Turns go round the teachers with queued requests; a turn sends at most TURN_REQUESTS of that teacher's requests at
once (the engine batches them), so no teacher waits on another's whole queue. Every reply must carry the teacher's
weight version, so no sample is scored by weights swapped in for another. A failed turn is retried after
`recover` restarted the engine (counted per teacher, like DirectScorer's).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from rollout.client import EngineClient, EngineUnavailableError
from rollout.teachers.direct import BACKOFF_S, MAX_ATTEMPTS, MAX_BACKOFF_S, Recover, TeacherUnavailableError
from rollout.teachers.scoring import TeacherScores, parse_scores, score_payload
from rollout.teachers.stats import TeacherStats

logger = logging.getLogger(__name__)

TURN_REQUESTS = 64  # a teacher's requests per turn: enough to batch well, few enough that others wait little


def teacher_version(name: str) -> str:
    """The weight_version a shared engine reports while it holds teacher `name`."""
    return f"teacher:{name}"


@dataclass
class _Job:
    sequences: list[list[int]]
    prompt_lens: list[int]
    future: asyncio.Future = field(repr=False)


class SwapEngine:
    """The shared engine of one swap group and the turns of its teachers."""

    def __init__(self, group: str, url: str, *, temperature: float, top_k: int = 0, recover: Recover | None = None,
                 timeout_s: float = 600.0, api_key: str | None = None) -> None:
        self.group, self.temperature, self.top_k = group, temperature, top_k
        self.recover, self.timeout_s = recover, timeout_s
        self.client = EngineClient([url], max_inflight_per_engine=TURN_REQUESTS, timeout_s=timeout_s, max_retries=0,
                                   api_key=api_key)
        self.paths: dict[str, str] = {}
        self.stats: dict[str, TeacherStats] = {}
        self._queues: dict[str, deque[_Job]] = {}
        self._loaded: str | None = None
        self._turn = 0
        self._wake = asyncio.Event()
        self._worker: asyncio.Task | None = None

    def add(self, name: str, path: str) -> SwapScorer:
        """Register teacher `name` (its checkpoint directory, preloaded by the engine); its scorer."""
        self.paths[name], self.stats[name], self._queues[name] = path, TeacherStats(), deque()
        return SwapScorer(name, self)

    async def score(self, name: str, sequences: list[list[int]], prompt_lens: list[int]) -> list[TeacherScores]:
        """Queue a request for teacher `name`'s next turn and wait for its scores."""
        job = _Job(sequences, prompt_lens, asyncio.get_running_loop().create_future())
        self._queues[name].append(job)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._run(), name=f"swap-{self.group}")
        self._wake.set()
        return await job.future

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while (name := self._next_teacher()) is not None:
                queue = self._queues[name]
                jobs = [queue.popleft() for _ in range(min(TURN_REQUESTS, len(queue)))]
                try:
                    await self._serve(name, jobs)
                except Exception as e:  # noqa: BLE001 - a turn's failure belongs to its requests
                    for job in jobs:
                        if not job.future.done():
                            job.future.set_exception(e)

    def _next_teacher(self) -> str | None:
        """The next teacher, in round-robin order, that has queued requests."""
        names = list(self._queues)
        for i in range(len(names)):
            name = names[(self._turn + i) % len(names)]
            if self._queues[name]:
                self._turn = (self._turn + i + 1) % len(names)
                return name
        return None

    async def _serve(self, name: str, jobs: list[_Job]) -> None:
        """One turn: swap `name` in if needed and score its jobs; failed jobs are retried after a recovery."""
        stats, pending = self.stats[name], jobs
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                if self._loaded != name:
                    await self._swap(name)
                results = await asyncio.gather(*(self._request(name, job) for job in pending), return_exceptions=True)
            except EngineUnavailableError as e:  # the swap itself failed
                results = [e] * len(pending)
            failed = []
            for job, result in zip(pending, results):
                if isinstance(result, EngineUnavailableError):
                    failed.append(job)
                    stats.retried_samples += len(job.sequences)
                elif isinstance(result, BaseException):
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result)
            if not failed:
                return
            pending = failed
            if attempt < MAX_ATTEMPTS:
                logger.info("swap group %s: %d request(s) of teacher %s failed; retrying", self.group, len(failed), name)
                await self._recover(stats)
                await asyncio.sleep(min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (attempt - 1)))
        error = TeacherUnavailableError(f"teacher '{name}' (swap group {self.group}) failed {MAX_ATTEMPTS} times")
        for job in pending:
            job.future.set_exception(error)

    async def _swap(self, name: str) -> None:
        start = time.perf_counter()
        url = next(iter(self.client.engines))
        body = {"model_path": self.paths[name], "weight_version": teacher_version(name)}
        self._loaded = None
        await self.client.post_to(url, "/update_weights_from_disk", body, timeout_s=self.timeout_s)
        self._loaded = name
        stats = self.stats[name]
        stats.swaps += 1
        stats.swap_s += time.perf_counter() - start
        logger.debug("swap group %s: %s swapped in (%.3f s)", self.group, name, time.perf_counter() - start)

    async def _request(self, name: str, job: _Job) -> list[TeacherScores]:
        stats = self.stats[name]
        payload = score_payload(job.sequences, job.prompt_lens, self.temperature, self.top_k)
        with stats.busy():
            body, url = await self.client.request("/generate", payload, abort_rid=payload["rid"])
        scores = parse_scores(body, f"teacher '{name}' at {url}/generate", job.sequences, job.prompt_lens,
                              self.temperature, self.top_k, weight_version=teacher_version(name))
        stats.requests += 1
        stats.samples += len(job.sequences)
        stats.tokens += sum(len(s) for s in job.sequences)
        stats.response_tokens += sum(s.num_tokens for s in scores)
        return scores

    async def _recover(self, stats: TeacherStats) -> None:
        """Restart the shared engine if it does not answer /health; whoever holds it must be swapped in again."""
        url = next(iter(self.client.engines))
        try:
            if await self.client.get(url, "/health", timeout_s=5.0) is None:
                return
        except Exception:  # noqa: BLE001 - whatever the failure, it is not alive
            pass
        self._loaded = None
        if self.recover is None:
            return
        logger.warning("swap group %s: restarting its engine %s, which stopped answering", self.group, url)
        (new,) = await self.recover([url])
        self.client.replace_engine(url, new)
        stats.restarts += 1

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        await self.client.close()


class SwapScorer:
    """One teacher of a swap group, with DirectScorer's interface (score, stats)."""

    def __init__(self, name: str, engine: SwapEngine) -> None:
        self.name, self.engine = name, engine

    @property
    def stats(self) -> TeacherStats:
        return self.engine.stats[self.name]

    async def score(self, sequences: list[list[int]], prompt_lens: list[int]) -> list[TeacherScores]:
        return await self.engine.score(self.name, sequences, prompt_lens)

    async def close(self) -> None:
        """The swap engine is closed by whoever owns it (TeacherPool)."""
