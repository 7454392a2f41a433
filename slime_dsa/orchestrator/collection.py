"""One synchronous step's rollouts: which groups are trainable, DAPO dynamic sampling, and the step's rollout metrics.

With dynamic sampling, a group whose rewards all agree teaches nothing and is dropped; the step samples more
prompts, in rounds, until it holds rollout.prompts_per_step trainable groups or has run max_sampling_tries rounds.
A round draws what the last round's keep share says is needed, so one round usually fills the step.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from typing import TYPE_CHECKING, NamedTuple

from rollout.groups import GroupRollout, SampleNumbering
from rollout.progress import SampleProgress
from slime_dsa.data.sample import Sample, SampleStatus

if TYPE_CHECKING:
    from slime_dsa.config.schema import RolloutSection
    from slime_dsa.data.prompts import TaskMixture


def screen_group(group: list[Sample], dynamic_sampling: bool, counters: Counter,
                 min_samples: int = 2) -> list[Sample] | None:
    """The group's trainable samples, or None when the group cannot be trained on; counts why in `counters`.

    min_samples: the fewest usable samples that teach the algorithm something (2 for group advantages, 1 for a
    critic's: Algorithm.min_group_size)."""
    usable = [s for s in group if s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)]
    counters["failed_samples"] += len(group) - len(usable)
    if len(usable) < max(min_samples, 1):
        counters["dropped_groups"] += 1
        return None
    if len(usable) > 1 and len({s.reward for s in usable}) == 1:
        counters["zero_std_groups"] += 1
        if dynamic_sampling:
            return None
    return usable


def failure_example(samples: list[Sample]) -> str | None:
    """The error of the first sample that failed or was aborted with one, or None."""
    for s in samples:
        if s.status in (SampleStatus.FAILED, SampleStatus.ABORTED) and s.metadata.get("error"):
            return str(s.metadata["error"])
    return None


def rollout_metrics(samples: list[Sample], kept: list[list[Sample]], counters: Counter, elapsed: float,
                    task_names: list[str], reward_metrics: dict[str, float]) -> dict[str, float]:
    """rollout/ and perf/ metrics of one step: `samples` all it generated, `kept` the groups it trains on."""
    scored = [s for s in samples if s.reward is not None]
    n = max(len(scored), 1)
    out_tokens = sum(s.response_length for s in samples)
    metrics = {
        # fsum: exactly rounded whatever order the samples finished in (the async loop's differs from run to run)
        "rollout/reward_mean": math.fsum(s.reward for s in scored) / n,
        "rollout/response_length_mean": sum(s.response_length for s in scored) / n,
        "rollout/truncated_frac": sum(s.status == SampleStatus.TRUNCATED for s in samples) / max(len(samples), 1),
        "rollout/num_samples": len(samples),
        # what the policy generated (loss_mask 1: tool/environment tokens excluded): the budget comparisons count
        "rollout/generated_tokens": sum(sum(s.loss_mask) for s in samples),
        "rollout/num_groups_trained": len(kept),
        "rollout/zero_std_groups": counters["zero_std_groups"],
        "rollout/dropped_groups": counters["dropped_groups"],
        "rollout/failed_samples": counters["failed_samples"],
        **reward_metrics,
        "perf/rollout_time_s": elapsed,
        "perf/rollout_tok_s": out_tokens / max(elapsed, 1e-9),
    }
    for name in task_names:
        mine = [s.reward for s in scored if s.task == name]
        if mine and len(task_names) > 1:
            metrics[f"rollout/{name}/reward_mean"] = math.fsum(mine) / len(mine)
    return metrics


class _PrefetchedRound(NamedTuple):
    """A step's first round sent ahead (StepCollector.prefetch)."""

    num_prompts: int
    groups: asyncio.Future  # of the round's generated groups
    requests_sent_before: int  # the coalescer's bodies sent before it (perf/rollout_requests)


class StepCollector:
    """The groups of one synchronous step, drawn from `mixture` and numbered by `numbering`; `keep_share` (the
    share of groups the last round kept) sizes the next round and is part of the resume state."""

    def __init__(self, groups: GroupRollout, mixture: TaskMixture, numbering: SampleNumbering,
                 rollout: RolloutSection, show_progress: bool = True, min_group_size: int = 2) -> None:
        self.groups, self.mixture, self.numbering, self.cfg = groups, mixture, numbering, rollout
        self.show_progress = show_progress
        self.min_group_size = min_group_size  # screen_group's min_samples
        self.keep_share = 1.0
        self.last_error: str | None = None  # a failed sample's error in the last collected step (failure_example)
        self._prefetched: _PrefetchedRound | None = None

    def round_size(self, need: int) -> int:
        """Prompts to draw in a dynamic-sampling round that still needs `need` groups: enough to fill it at the
        last round's keep share, times oversample_factor, at most max_oversample_factor times `need`."""
        cfg = self.cfg
        wanted = need * cfg.oversample_factor / max(self.keep_share, 1e-6)
        return max(need, min(round(wanted), round(need * cfg.max_oversample_factor)))

    def prefetch(self) -> None:
        """Send the next step's first sampling round now (the prompts it would draw first, numbered as it would);
        collect() takes its groups up. The caller holds the engines paused until they have that step's weights."""
        if self._prefetched is not None:
            raise RuntimeError("a prefetched round is already waiting to be collected")
        cfg = self.cfg
        self.groups.reset_reward_stats()
        self.groups.clock.start()
        sent_before = self._requests_sent()
        fresh = self._draw_round(cfg.prompts_per_step)
        groups = asyncio.gather(*(self.groups.generate_group(group) for group in fresh))
        self._prefetched = _PrefetchedRound(len(fresh), groups, sent_before)

    def cancel_prefetch(self) -> None:
        """Drop a prefetched round that will not be collected (the run is ending)."""
        if self._prefetched is not None:
            self._prefetched.groups.cancel()
            self._prefetched = None

    def _requests_sent(self) -> int:
        """Bodies the client's coalescer sent so far (rollout.coalesce_calls), 0 without one."""
        coalescer = getattr(self.groups.client, "coalescer", None)
        return coalescer.requests_sent() if coalescer is not None else 0

    def _draw_round(self, need: int) -> list[list[Sample]]:
        """A sampling round's fresh groups, numbered: its prompts drawn for `need` groups (more with dynamic
        sampling)."""
        cfg = self.cfg
        prompts = self.mixture.take(self.round_size(need) if cfg.dynamic_sampling else need)
        return [self.numbering.new_group(p, cfg.n_samples_per_prompt) for p in prompts]

    async def collect(self) -> tuple[list[list[Sample]], dict[str, float]]:
        """The step's trainable groups, in prompt order, and its rollout metrics. A prefetched first round is taken
        up (its perf/rollout_dispatch_s and _generate_s count from when it was sent)."""
        cfg = self.cfg
        prefetched, self._prefetched = self._prefetched, None
        was_prefetched = prefetched is not None
        if prefetched is None:
            self.groups.reset_reward_stats()
            self.groups.clock.start()
        sent_before = prefetched.requests_sent_before if prefetched is not None else self._requests_sent()
        start = time.perf_counter()
        kept: list[list[Sample]] = []
        counters: Counter[str] = Counter()
        every: list[Sample] = []
        rounds, max_rounds = 0, cfg.max_sampling_tries if cfg.dynamic_sampling else 1
        with SampleProgress("rollout", show=self.show_progress) as bar:
            while len(kept) < cfg.prompts_per_step and rounds < max_rounds:
                if rounds and not getattr(self.groups.client, "engines", True):
                    break  # every engine is lost: a round would only burn its prompts (the next step waits for some)
                rounds += 1
                need = cfg.prompts_per_step - len(kept)
                if prefetched is not None:
                    bar.add_total(prefetched.num_prompts * cfg.n_samples_per_prompt)
                    done = await prefetched.groups
                    prefetched = None
                    bar.advance(sum(len(group) for group in done))
                else:
                    fresh = self._draw_round(need)
                    bar.add_total(len(fresh) * cfg.n_samples_per_prompt)
                    done = await asyncio.gather(*(self._generate(group, bar) for group in fresh))
                usable_groups, failed_before = 0, counters["failed_samples"]
                for group in done:
                    every.extend(group)
                    usable = screen_group(group, cfg.dynamic_sampling, counters, self.min_group_size)
                    usable_groups += usable is not None
                    if usable is not None and len(kept) < cfg.prompts_per_step:
                        kept.append(usable)
                generated = sum(len(group) for group in done)
                if generated and counters["failed_samples"] - failed_before == generated:
                    # Every sample failed: another round would only burn its prompts, and the keep share (how many
                    # groups' rewards disagree) learnt nothing.
                    break
                self.keep_share = usable_groups / len(done)
        end = time.perf_counter()
        self.last_error = failure_example(every)
        metrics = rollout_metrics(every, kept, counters, end - start,
                                  [t.name for t in self.groups.tasks], self.groups.reward_metrics())
        metrics.update(self.groups.clock.metrics(end))
        if getattr(self.groups.client, "coalescer", None) is not None:
            # perf/rollout_calls counts group calls; these are the bodies that carried them
            metrics["perf/rollout_requests"] = float(self._requests_sent() - sent_before)
        metrics["rollout/sampling_rounds"] = rounds
        metrics["perf/rollout_prefetched"] = float(was_prefetched)
        return kept, metrics

    async def _generate(self, group: list[Sample], bar: SampleProgress) -> list[Sample]:
        group = await self.groups.generate_group(group)
        bar.advance(len(group))
        return group
