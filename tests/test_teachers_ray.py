"""Teachers as a run starts them (slime_dsa.orchestrator.teachers, Ray actors, real embedded engines over loopback
HTTP): engines of their own and a shared swap engine score like a direct forward; killing a teacher's engine in the
middle of a step loses none of its samples (they are retried, counted, once its replacement answers) and costs
nothing to the other teachers; ten teachers score a hundred concurrent samples each."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import torch

from slime_dsa.config import validate_recipe
from slime_dsa.data.sample import Sample, SampleStatus
from tests.teacher_helpers import direct_scores, make_expert

logger = logging.getLogger(__name__)
pytestmark = pytest.mark.slow


def _recipe(teachers: list[dict], tasks: list[str]) -> object:
    return validate_recipe({
        "algorithm": {"name": "opd"}, "rollout": {"n_samples_per_prompt": 1, "temperature": 0.8},
        "data": {"tasks": [{"name": t, "kind": "arithmetic"} for t in tasks]},
        "cluster": {"num_cpus_per_actor": 0.5}, "teachers": teachers})


def _samples(task: str, n: int, length: int, seed: int, first_index: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, 300, (length,), generator=g).tolist()
        sample = Sample(prompt_ids=ids[:8], task=task, index=first_index + i, status=SampleStatus.COMPLETED)
        sample.append_tokens(ids[8:], [-1.0] * (length - 8))
        out.append(sample)
    return out


@pytest.fixture(scope="module")
def experts(tmp_path_factory):
    return [make_expert(tmp_path_factory.mktemp(f"expert{seed}"), seed) for seed in range(4)]


def test_engines_of_their_own_and_a_swap_engine_score_like_a_direct_forward(experts, ray_cluster):
    from slime_dsa.orchestrator.teachers import Teachers

    recipe = _recipe([{"name": "own", "path": str(experts[0]), "domains": ["a"]},
                      {"name": "s1", "path": str(experts[1]), "domains": ["b"], "serving": "swap"},
                      {"name": "s2", "path": str(experts[2]), "domains": ["c"], "serving": "swap"}], ["a", "b", "c"])

    async def run():
        teachers = Teachers(recipe, temperature=0.8, top_k=0)
        pool = await teachers.start([5, 6, 7])
        try:
            groups = {task: _samples(task, 3, 20, seed) for seed, task in enumerate("abc")}
            await pool.score_all([s for group in groups.values() for s in group])
            return groups, pool.metrics()
        finally:
            await teachers.close()

    groups, metrics = asyncio.run(run())
    for task, expert in zip("abc", experts):
        for sample in groups[task]:
            want, _, _ = direct_scores(expert, sample.tokens, len(sample.prompt_ids), 0.8)
            assert torch.allclose(torch.tensor(sample.teacher_logprobs), want, atol=1e-5, rtol=0)
            assert sample.metadata["teacher"] == {"a": "own", "b": "s1", "c": "s2"}[task]
    assert metrics["teacher/s1/swaps"] >= 1 and metrics["teacher/own/swaps"] == 0


def test_killing_a_teacher_engine_mid_step_loses_no_sample(experts, ray_cluster):
    import ray

    from slime_dsa.orchestrator.teachers import Teachers

    recipe = _recipe([{"name": "victim", "path": str(experts[0]), "domains": ["a"]},
                      {"name": "bystander", "path": str(experts[1]), "domains": ["b"]}], ["a", "b"])

    async def run():
        teachers = Teachers(recipe, temperature=0.8, top_k=0)
        pool = await teachers.start([5, 6, 7])
        try:
            victim = [_samples("a", 1, 60, seed, seed) for seed in range(60)]  # 60 groups of one
            bystander = [_samples("b", 1, 60, 100 + seed, 100 + seed) for seed in range(60)]
            jobs = [asyncio.create_task(pool.score_group(g)) for pair in zip(victim, bystander) for g in pair]
            stats = pool.scorers["victim"].stats
            while stats.requests < 3:  # some of its requests are done, most are in flight or queued
                await asyncio.sleep(0.01)
            assert stats.requests < len(victim)
            ray.kill(teachers.actors["victim"][0], no_restart=True)
            await asyncio.gather(*jobs)
            return victim, bystander, pool.metrics()
        finally:
            await teachers.close()

    victim, bystander, metrics = asyncio.run(run())
    every = [s for g in victim + bystander for s in g]
    assert all(s.status == SampleStatus.COMPLETED and s.teacher_logprobs is not None for s in every)
    assert metrics["teacher/victim/restarts"] == 1 and metrics["teacher/victim/retried_samples"] > 0
    assert metrics["teacher/victim/failed_samples"] == 0 and metrics["teacher/victim/samples"] == 60
    assert metrics["teacher/bystander/retried_samples"] == 0 and metrics["teacher/bystander/restarts"] == 0
    sample = victim[-1][0]  # scored by the replacement engine: the same teacher
    want, _, _ = direct_scores(experts[0], sample.tokens, len(sample.prompt_ids), 0.8)
    assert torch.allclose(torch.tensor(sample.teacher_logprobs), want, atol=1e-5, rtol=0)


def test_ten_teachers_score_a_hundred_concurrent_samples_each(experts, ray_cluster):
    """Six teachers on engines of their own, four taking turns on one shared engine (copies of four experts)."""
    from slime_dsa.orchestrator.teachers import Teachers

    tasks = [f"d{i}" for i in range(10)]
    teachers = [{"name": f"t{i}", "path": str(experts[i % 4]), "domains": [tasks[i]],
                 **({"serving": "swap"} if i >= 6 else {})} for i in range(10)]
    recipe = _recipe(teachers, tasks)

    async def run():
        fleet = Teachers(recipe, temperature=0.8, top_k=4)
        pool = await fleet.start([5, 6, 7])
        try:
            groups = [_samples(task, 1, 24, 1000 * i + j, 1000 * i + j) for i, task in enumerate(tasks)
                      for j in range(100)]
            start = time.perf_counter()
            await asyncio.gather(*(pool.score_group(g) for g in groups))
            return groups, time.perf_counter() - start, pool.metrics()
        finally:
            await fleet.close()

    groups, wall, metrics = asyncio.run(run())
    assert all(g[0].teacher_logprobs is not None and g[0].teacher_topk_ids.shape == (16, 4) for g in groups)
    for i in range(10):
        assert metrics[f"teacher/t{i}/samples"] == 100 and metrics[f"teacher/t{i}/failed_samples"] == 0
    logger.warning("10 teachers x 100 concurrent samples (24 tokens, top-4): %.1f s wall; tok/s per teacher: %s",
                   wall, {f"t{i}": round(metrics[f"teacher/t{i}/tok_s"]) for i in range(10)})
