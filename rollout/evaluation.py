"""Evaluation: greedy responses on every task's held-out prompts, scored by the task's reward function.

One implementation for the RL loop (through the engines' EngineClient) and for SFT (through an InProcessClient).
A reward of at least 1 counts as a pass.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from rollout.groups import GenerateClient, GroupRollout, SampleNumbering
from rollout.limiter import SampleLimiter
from rollout.progress import SampleProgress
from slime_dsa.data.sample import Sample

if TYPE_CHECKING:
    from slime_dsa.config.schema import RolloutSection
    from slime_dsa.data.prompts import Prompt, Task


def eval_prompts(tasks: list[Task], max_prompts: int | None = None) -> list[Prompt]:
    """The first `max_prompts` (default all) held-out prompts of each task that has an eval split, task by task."""
    return [p for task in tasks if task.eval is not None for p in list(task.eval)[:max_prompts]]


def eval_metrics(rewards: dict[str, list[float]]) -> dict[str, float]:
    """eval/<task>/reward_mean and eval/<task>/pass@1 for each task's rewards, then eval/reward_mean, eval/pass@1."""
    metrics: dict[str, float] = {}
    for name, mine in rewards.items():
        metrics[f"eval/{name}/reward_mean"] = sum(mine) / len(mine)
        metrics[f"eval/{name}/pass@1"] = sum(r >= 1.0 for r in mine) / len(mine)
    every = [r for mine in rewards.values() for r in mine]
    if every:
        metrics["eval/reward_mean"] = sum(every) / len(every)
        metrics["eval/pass@1"] = sum(r >= 1.0 for r in every) / len(every)
    return metrics


class Evaluator:
    """Greedy evaluation through `client`, one request per prompt. Its samples take their indices from `numbering`
    (the RL loop shares its own, so training samples are numbered as they always were); its reward failures are
    counted apart from training's. Eval samples are never trained on: no indexer top-k is asked for."""

    def __init__(self, client: GenerateClient, tasks: list[Task], tokenizer: Any, rollout: RolloutSection,
                 numbering: SampleNumbering | None = None, *, seed: int = 0, limiter: SampleLimiter | None = None,
                 show_progress: bool = True) -> None:
        self.groups = GroupRollout(client, tasks, tokenizer, rollout, seed, limiter, indexer_topk=False)
        self.numbering = numbering or SampleNumbering()
        self.show_progress = show_progress

    async def evaluate(self, max_prompts: int | None = None) -> dict[str, float]:
        """eval/ metrics (see eval_metrics) on at most `max_prompts` prompts per task."""
        groups = [self.numbering.new_group(p, 1) for p in eval_prompts(self.groups.tasks, max_prompts)]
        with SampleProgress("eval", len(groups), self.show_progress) as bar:
            done = await asyncio.gather(*(self._generate(group, bar) for group in groups))
        rewards: dict[str, list[float]] = {}
        for (sample,) in done:
            rewards.setdefault(sample.task, []).append(float(sample.reward or 0.0))
        return eval_metrics(rewards)

    async def _generate(self, group: list[Sample], bar: SampleProgress) -> list[Sample]:
        group = await self.groups.generate_group(group, greedy=True)
        bar.advance(len(group))
        return group
