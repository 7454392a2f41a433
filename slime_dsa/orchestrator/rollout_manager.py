"""The rollout side of an RL run: one object that builds the rollout pieces over shared state and saves that state.

The pieces, one concept each: group generation and scoring (rollout.groups.GroupRollout), one synchronous step's
collection with dynamic sampling (collection.StepCollector), the asynchronous producer (producer.GroupProducer)
and evaluation (rollout.evaluation.Evaluator). They share the task mixture (the data position) and the sample
numbering, so the prompts a run draws and the seeds its samples get do not depend on which piece ran when. The
checkpoint's rollout state spans them too: mixture, numbering, keep share and pending groups, in one dict.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from rollout.evaluation import Evaluator
from rollout.groups import GenerateClient, GroupRollout, SampleNumbering
from rollout.limiter import SampleLimiter
from slime_dsa.data.sample import Sample
from slime_dsa.orchestrator.buffer import SampleBuffer, StalenessGate
from slime_dsa.orchestrator.collection import StepCollector, rollout_metrics
from slime_dsa.orchestrator.producer import GroupProducer

if TYPE_CHECKING:
    from rollout.teachers.pool import TeacherPool
    from slime_dsa.config.schema import RolloutSection
    from slime_dsa.data.prompts import Task, TaskMixture


class RolloutManager:
    """Builds the rollout pieces of a run over one mixture and one numbering; the loops call them through it."""

    def __init__(self, client: GenerateClient, tasks: list[Task], mixture: TaskMixture, tokenizer: Any,
                 rollout: RolloutSection, buffer: SampleBuffer | None = None, show_progress: bool = True,
                 seed: int = 0, min_group_size: int = 2, max_concurrency: int | None = None,
                 teachers: TeacherPool | None = None) -> None:
        """max_concurrency: samples in flight, the recipe's resolved value (RecipeConfig.max_concurrency); None =
        rollout.max_concurrency, or one step's samples when that is null. teachers: scores each group as it
        finishes (on-policy distillation)."""
        self.tasks, self.mixture = tasks, mixture
        self.numbering = SampleNumbering()
        limiter = SampleLimiter(max_concurrency) if max_concurrency is not None else None
        self.groups = GroupRollout(client, tasks, tokenizer, rollout, seed, limiter=limiter, teachers=teachers)
        self.min_group_size = min_group_size  # the fewest usable samples a group needs (Algorithm.min_group_size)
        self.collector = StepCollector(self.groups, mixture, self.numbering, rollout, show_progress, min_group_size)
        self.producer = GroupProducer(self.groups, mixture, self.numbering, rollout, buffer)
        # Evaluation shares the numbering (its samples have always taken indices between two steps') and the
        # limit on samples in flight, which it runs beside the producer in the asynchronous loop.
        self.evaluator = Evaluator(client, tasks, tokenizer, rollout, self.numbering, seed=seed,
                                   limiter=self.groups.limiter, show_progress=show_progress)

    async def collect_step(self) -> tuple[list[list[Sample]], dict[str, float]]:
        """One synchronous step's trainable groups and their rollout metrics (with a round prefetched, its groups)."""
        return await self.collector.collect()

    def prefetch_step(self) -> None:
        """Send the next synchronous step's first round now (StepCollector.prefetch); collect_step takes it up."""
        self.collector.prefetch()

    def cancel_prefetch(self) -> None:
        """Drop a prefetched round that will not be collected (StepCollector.cancel_prefetch)."""
        self.collector.cancel_prefetch()

    async def produce(self, gate: StalenessGate, requeue_aborted: bool) -> None:
        """The asynchronous loop's producer (GroupProducer.produce); runs until cancelled."""
        await self.producer.produce(gate, requeue_aborted)

    async def evaluate(self, max_prompts: int | None = None) -> dict[str, float]:
        """Greedy eval/ metrics on every task's held-out prompts."""
        return await self.evaluator.evaluate(max_prompts)

    # -- what the asynchronous loop reads of the producer ---------------------------------------

    @property
    def buffer(self) -> SampleBuffer:
        return self.producer.buffer

    @property
    def in_flight(self) -> dict[int, list[int]]:
        return self.producer.in_flight

    @property
    def produced_indices(self) -> list[int]:
        return self.producer.produced_indices

    @property
    def num_pending_replays(self) -> int:
        return self.producer.num_pending_replays

    def rollout_metrics(self, samples: list[Sample], kept: list[list[Sample]], counters: Counter,
                        elapsed: float) -> dict[str, float]:
        """collection.rollout_metrics, with the reward failures and timeouts counted since reset_reward_stats."""
        return rollout_metrics(samples, kept, counters, elapsed, [t.name for t in self.tasks],
                               self.groups.reward_metrics())

    def reset_reward_stats(self) -> None:
        self.groups.reset_reward_stats()

    # -- state for exact resumption -------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The data position, the numbering, the keep share and the producer's pending groups; call it on the event
        loop (the producer moves them)."""
        return {"mixture": self.mixture.state_dict(), "next_sample_index": self.numbering.next_sample_index,
                "next_group_id": self.numbering.next_group_id, "pending_groups": self.producer.pending_groups(),
                "keep_share": self.collector.keep_share}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mixture.load_state_dict(state["mixture"])
        self.numbering.next_sample_index = state["next_sample_index"]  # in place: every piece holds this numbering
        self.numbering.next_group_id = state["next_group_id"]
        self.producer.load_pending_groups(state.get("pending_groups", []))
        self.collector.keep_share = state.get("keep_share", 1.0)
