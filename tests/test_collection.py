"""Synchronous collection (slime_dsa.orchestrator.collection) against a fake client: the step's groups come straight
back (no buffer), numbered in prompt order; DAPO rounds grow the progress bar's total, which is never exceeded."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace

from slime_dsa.data.sample import Sample, SampleStatus
from tests.fake_client import FakeClient

TOKENIZER = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))


def _task(n_prompts: int = 64):
    """Prompts answered "mixed" (every 4th: rewards 0/1 by sample index) or "zero" (always 0)."""
    from slime_dsa.data.prompts import Prompt, Task

    prompts = [Prompt(task="t", split="train", index=i, prompt_ids=[3 + i % 40, 4, 5], prompt_text="",
                      answer="mixed" if i % 4 == 0 else "zero") for i in range(n_prompts)]
    return Task(name="t", kind="arithmetic", weight=1.0, reward_fn="tests.plugins.rewards:mixed_or_zero",
                train=prompts, eval=None)


def _collector(**rollout):
    from rollout.groups import GroupRollout, SampleNumbering
    from slime_dsa.config.schema import RolloutSection
    from slime_dsa.data.prompts import TaskMixture
    from slime_dsa.orchestrator.collection import StepCollector

    task, cfg = _task(), RolloutSection(max_response_length=3, **rollout)
    groups = GroupRollout(FakeClient(), [task], TOKENIZER, cfg)
    return StepCollector(groups, TaskMixture([task]), SampleNumbering(), cfg, show_progress=False)


def test_a_step_returns_its_groups_in_prompt_order_without_a_buffer():
    from slime_dsa.data.prompts import TaskMixture
    from slime_dsa.orchestrator.rollout_manager import RolloutManager

    task = _task()
    cfg = _collector(n_samples_per_prompt=2, prompts_per_step=4).cfg
    manager = RolloutManager(FakeClient(), [task], TaskMixture([task]), TOKENIZER, cfg, show_progress=False)

    async def main():
        return [await manager.collect_step() for _ in range(2)]

    (first, m1), (second, m2) = asyncio.run(main())
    assert [[s.index for s in g] for g in first + second] == [[2 * k, 2 * k + 1] for k in range(8)]
    assert [g[0].group_id for g in first + second] == list(range(8))
    assert len(manager.buffer) == 0 and manager.producer.in_flight == {}
    assert m1["rollout/num_samples"] == m2["rollout/num_samples"] == 8 and m1["rollout/sampling_rounds"] == 1
    assert m1["rollout/zero_std_groups"] == sum(g[0].answer == "zero" for g in first)  # kept without dynamic sampling
    assert manager.state_dict()["next_sample_index"] == 16


def test_dynamic_sampling_progress_total_grows_with_each_round(monkeypatch):
    from rollout.progress import SampleProgress
    from slime_dsa.orchestrator import collection

    seen: list[tuple[int, int]] = []  # (done, total) after every change

    class Recorded(SampleProgress):
        def add_total(self, count: int) -> None:
            super().add_total(count)
            seen.append((self.done, self.total))

        def advance(self, count: int) -> None:
            super().advance(count)
            seen.append((self.done, self.total))

    monkeypatch.setattr(collection, "SampleProgress", Recorded)
    collector = _collector(n_samples_per_prompt=2, prompts_per_step=4, dynamic_sampling=True)
    groups, metrics = asyncio.run(collector.collect())
    assert len(groups) == 4 and metrics["rollout/sampling_rounds"] > 1
    assert all(done <= total for done, total in seen)
    assert seen[-1] == (metrics["rollout/num_samples"], metrics["rollout/num_samples"])
    assert seen[-1][1] > 4 * 2  # a fixed total of prompts_per_step x n would have been overshot


def test_screen_group_counts_why_a_group_is_left_out():
    from slime_dsa.orchestrator.collection import screen_group

    def group(*rewards, status=SampleStatus.COMPLETED):
        return [Sample(prompt_ids=[1], reward=r, status=status) for r in rewards]

    counters: Counter[str] = Counter()
    assert screen_group(group(0.0, 1.0), True, counters) is not None
    assert screen_group(group(1.0, 1.0), True, counters) is None  # uniform rewards: dropped under dynamic sampling
    assert screen_group(group(1.0, 1.0), False, counters) is not None  # counted, kept without
    failed = group(0.0, 1.0, 1.0)
    failed[0].status = SampleStatus.FAILED
    assert screen_group(failed, False, counters) is not None
    assert screen_group(group(0.0, 1.0, status=SampleStatus.ABORTED), False, counters) is None
    assert counters == {"zero_std_groups": 3, "failed_samples": 3, "dropped_groups": 1}


def test_progress_bar_writes_nothing_to_a_pipe_or_file(capfd):
    """Off a terminal the bar is not drawn: a log file or pipe gets no blank line per step (stdout nor stderr)."""
    from rollout.progress import SampleProgress

    for _ in range(3):
        with SampleProgress("rollout", 4) as bar:
            bar.add_total(4)
            bar.advance(8)
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    assert (bar.done, bar.total) == (8, 8)


def _step_records(collector, prefetch_at: set[int], steps: int = 3):
    """Each step's (sample indices, prompt indices, output ids, perf/rollout_prefetched), prefetching the steps in
    `prefetch_at` during the step before (as the synchronous loop does during its train call)."""

    async def main():
        records = []
        for step in range(steps):
            groups, metrics = await collector.collect()
            records.append(([s.index for g in groups for s in g], [g[0].prompt_ids for g in groups],
                            [s.response_ids for g in groups for s in g], metrics["perf/rollout_prefetched"]))
            if step + 1 in prefetch_at:
                collector.prefetch()
                await asyncio.sleep(0)  # the train call: the round's calls go out meanwhile
        return records

    return asyncio.run(main())


def test_a_prefetched_round_is_the_round_the_step_would_have_drawn():
    plain = _step_records(_collector(n_samples_per_prompt=2, prompts_per_step=4), set())
    ahead = _step_records(_collector(n_samples_per_prompt=2, prompts_per_step=4), {1, 2})
    assert [r[:3] for r in ahead] == [r[:3] for r in plain]  # same samples, prompts and answers
    assert [r[3] for r in ahead] == [0.0, 1.0, 1.0] and [r[3] for r in plain] == [0.0, 0.0, 0.0]
    dynamic = dict(n_samples_per_prompt=2, prompts_per_step=4, dynamic_sampling=True, oversample_factor=1.5)
    plain = _step_records(_collector(**dynamic), set(), steps=4)
    ahead = _step_records(_collector(**dynamic), {2}, steps=4)  # its keep share sizes the round as collect would
    assert [r[:3] for r in ahead] == [r[:3] for r in plain]


def test_a_prefetch_sends_its_calls_before_collect_and_can_be_cancelled():
    collector = _collector(n_samples_per_prompt=2, prompts_per_step=4)
    client = collector.groups.client

    async def main():
        collector.prefetch()
        try:
            collector.prefetch()
        except RuntimeError as e:
            second = str(e)
        await asyncio.sleep(0.01)
        sent = len(client.requests)
        collector.cancel_prefetch()
        groups, metrics = await collector.collect()  # a cancelled round is not taken up: a fresh one is drawn
        return sent, second, groups, metrics

    sent, second, groups, metrics = asyncio.run(main())
    assert sent == 4 and "already waiting" in second
    assert metrics["perf/rollout_prefetched"] == 0.0 and [g[0].group_id for g in groups] == [4, 5, 6, 7]


def test_no_step_before_an_evaluation_a_checkpoint_or_the_end_prefetches():
    from slime_dsa.config.schema import RecipeConfig
    from slime_dsa.orchestrator.train import prefetches

    recipe = RecipeConfig.model_validate({"data": {"tasks": [{"kind": "arithmetic", "eval_size": 8}]},
                                          "rollout": {"prefetch_next_step": True}, "trainer": {"num_steps": 7},
                                          "logging": {"eval_every": 3}, "checkpoint": {"save_every": 5}})
    # step s (from 0) is followed by step s + 1's evaluation or checkpoint when s + 1 is a multiple of 3 or 5
    assert [prefetches(recipe, s) for s in range(7)] == [True, True, False, True, False, False, False]
    assert not any(prefetches(RecipeConfig(), s) for s in range(3))  # off by default
    # the calls wait through a train call and a push: not when the last ones took over half their timeout
    timeout = recipe.rollout.request_timeout_s
    assert prefetches(recipe, 0, hold_s=0.5 * timeout) and not prefetches(recipe, 0, hold_s=0.5 * timeout + 1)


def test_a_step_with_no_group_to_train_on_says_why():
    """A step whose groups all got equal rewards (the GPU smoke's countdown with an arithmetic model: 864 groups, all
    0) warned 'all failed or dropped'; the line now gives the counts of each reason."""
    from slime_dsa.orchestrator.collection import rollout_metrics, screen_group
    from slime_dsa.orchestrator.train import skipped_step_line

    groups = [[Sample(prompt_ids=[1], response_ids=[2], reward=0.0, status=SampleStatus.COMPLETED) for _ in range(4)]
              for _ in range(3)]
    groups[2][0].status = groups[2][1].status = groups[2][2].status = SampleStatus.FAILED
    counters: Counter[str] = Counter()
    kept = [g for g in (screen_group(group, True, counters) for group in groups) if g is not None]
    assert kept == []
    metrics = rollout_metrics([s for g in groups for s in g], kept, counters, 1.0, ["arithmetic"], {})
    line = skipped_step_line(3, metrics, dynamic_sampling=True)
    assert line == ("step 3: no group to train on (2 whose rewards all agree (no advantage; dropped by "
                    "rollout.dynamic_sampling), 1 with too few usable samples, 3 samples failed); skipping the update")
    assert "rewards all agree" not in skipped_step_line(3, metrics, dynamic_sampling=False)
