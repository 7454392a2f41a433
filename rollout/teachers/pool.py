"""Every teacher of a run and the domain each owns: a sample goes to its domain's teacher (its task's), and all
teachers score at the same time (one scorer each: its own engines, or its turn on a shared swap engine).

`score_group` fills the teacher fields of a group's samples (rollout.groups calls it as each group finishes, while
other groups still generate); a teacher that never comes back costs its own samples only: they are marked failed,
counted, and the run goes on.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from rollout.teachers.direct import TeacherUnavailableError
from rollout.teachers.scoring import TeacherScores
from rollout.teachers.stats import TeacherStats
from slime_dsa.data.sample import Sample, SampleStatus

logger = logging.getLogger(__name__)


class Scorer(Protocol):
    """What the pool needs of a teacher (DirectScorer, SwapScorer)."""

    name: str
    stats: TeacherStats

    async def score(self, sequences: list[list[int]], prompt_lens: list[int]) -> list[TeacherScores]: ...

    async def close(self) -> None: ...


class TeacherPool:
    """The run's teachers by name, and by the domains they own."""

    def __init__(self, scorers: list[Scorer], domains: dict[str, list[str]], closers: list = ()) -> None:
        """domains: teacher name -> the task names it owns; closers: what else to close (shared swap engines)."""
        self.scorers = {s.name: s for s in scorers}
        self.by_domain = {domain: self.scorers[name] for name, owned in domains.items() for domain in owned}
        self._closers = list(closers)

    def teacher_of(self, domain: str) -> str | None:
        """The name of the teacher that owns `domain` (a task name), or None for a reward domain."""
        scorer = self.by_domain.get(domain)
        return None if scorer is None else scorer.name

    async def score_group(self, samples: list[Sample]) -> None:
        """Fill teacher_logprobs (and the top-k) of the group's finished samples; mark them failed if their teacher
        never answers."""
        scorer = self.by_domain.get(samples[0].task) if samples else None
        todo = [s for s in samples if s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)]
        if scorer is None or not todo:
            return
        try:
            scores = await scorer.score([s.tokens for s in todo], [len(s.prompt_ids) for s in todo])
        except TeacherUnavailableError as e:
            scorer.stats.failed_samples += len(todo)
            for sample in todo:
                sample.status = SampleStatus.FAILED
                sample.metadata["error"] = str(e)
            logger.warning("samples %d-%d: %s", todo[0].index, todo[-1].index, e)
            return
        for sample, score in zip(todo, scores):
            sample.teacher_logprobs = score.logprobs
            sample.teacher_topk_ids, sample.teacher_topk_logprobs = score.topk_ids, score.topk_logprobs
            sample.metadata["teacher"] = scorer.name

    async def score_all(self, samples: list[Sample]) -> None:
        """score_group for samples of any domains: one request per domain's run of samples, all at once."""
        runs: list[list[Sample]] = []
        for sample in samples:
            if runs and runs[-1][0].task == sample.task:
                runs[-1].append(sample)
            else:
                runs.append([sample])
        await asyncio.gather(*(self.score_group(run) for run in runs))

    def metrics(self) -> dict[str, float]:
        """teacher/<name>/... counters since the last reset (TeacherStats.metrics)."""
        out: dict[str, float] = {}
        for name, scorer in self.scorers.items():
            out.update(scorer.stats.metrics(f"teacher/{name}"))
        return out

    def reset_metrics(self) -> None:
        for scorer in self.scorers.values():
            scorer.stats.reset()

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.scorers.values()), *(c.close() for c in self._closers))
