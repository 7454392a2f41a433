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
            return groups, pool.metrics(), [await _status_without_key(u) for urls in teachers.urls.values()
                                            for u in urls]
        finally:
            await teachers.close()

    groups, metrics, keyless = asyncio.run(run())
    assert keyless == [401, 401]  # the engines the run starts take the run's key only (they were open to any caller)
    for task, expert in zip("abc", experts):
        for sample in groups[task]:
            want, _, _ = direct_scores(expert, sample.tokens, len(sample.prompt_ids), 0.8)
            assert torch.allclose(torch.tensor(sample.teacher_logprobs), want, atol=1e-5, rtol=0)
            assert sample.metadata["teacher"] == {"a": "own", "b": "s1", "c": "s2"}[task]
    assert metrics["teacher/s1/swaps"] >= 1 and metrics["teacher/own/swaps"] == 0


async def _status_without_key(url: str) -> int:
    """The HTTP status of a state-changing request sent without an API key."""
    import aiohttp

    async with aiohttp.ClientSession() as session, session.post(f"{url}/flush_cache", json={}) as response:
        return response.status


def test_killing_a_teacher_engine_mid_step_loses_no_sample(experts, ray_cluster):
    import ray

    from slime_dsa.orchestrator.teachers import Teachers

    recipe = _recipe([{"name": "victim", "path": str(experts[0]), "domains": ["a"]},
                      {"name": "bystander", "path": str(experts[1]), "domains": ["b"]}], ["a", "b"])

    async def run():
        teachers = Teachers(recipe, temperature=0.8, top_k=0)
        pool = await teachers.start([5, 6, 7])
        try:
            # 240 groups of one: enough that most are still queued or in flight when the kill comes, also on a
            # loaded machine where this loop's polls come late
            victim = [_samples("a", 1, 120, seed, seed) for seed in range(240)]
            bystander = [_samples("b", 1, 60, 1000 + seed, 1000 + seed) for seed in range(60)]
            jobs = [asyncio.create_task(pool.score_group(g)) for g in victim + bystander]
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
    assert metrics["teacher/victim/failed_samples"] == 0 and metrics["teacher/victim/samples"] == 240
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


def test_one_real_step_mixes_a_taught_domain_and_a_reward_domain_under_the_topk_kl(tmp_path, monkeypatch, ray_cluster):
    """The whole loop with opd_topk: arithmetic has a teacher (top-4 KL in the loss, no advantage), countdown has
    none (GRPO's group advantages), in one batch."""
    import json

    import yaml

    from slime_dsa.algorithms import specs
    from slime_dsa.config import load_recipe
    from slime_dsa.orchestrator.train import run_training
    from tests.plugins.recording import recording

    record = tmp_path / "loss.jsonl"
    monkeypatch.setitem(specs.ALGORITHMS, "opd", recording(specs.ALGORITHMS["opd"], str(record)))
    recipe = {
        "model": {"path": str(make_expert(tmp_path / "student", seed=0))}, "algorithm": {"name": "opd", "opd_topk": 4},
        "data": {"tasks": [{"kind": "arithmetic", "reward_fn": "tests.plugins.rewards:digit_fraction"},
                           {"kind": "countdown", "reward_fn": "tests.plugins.rewards:digit_fraction"}],
                 "max_prompt_length": 128},
        "rollout": {"n_samples_per_prompt": 2, "prompts_per_step": 4, "max_response_length": 8},
        "trainer": {"num_steps": 1, "micro_batch_tokens": 512, "learning_rate": 1e-3},
        "teachers": [{"name": "calc", "path": str(make_expert(tmp_path / "expert", seed=7)),
                      "domains": ["arithmetic"], "serving": "swap"}],
        "logging": {"wandb_mode": "disabled", "run_dir": str(tmp_path / "run")},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run_dir = run_training(load_recipe(path))
    (adv,) = [json.loads(line) for line in record.with_suffix(".advantages.jsonl").read_text().splitlines()]
    index, mask = torch.tensor(adv["sample_index"]), torch.tensor(adv["loss_mask"])
    taught = torch.tensor(adv["taught"]).bool()
    assert taught.any() and not taught.all()  # both domains in the batch
    advantages = torch.tensor(adv["advantages"])
    assert bool((advantages[taught[index] & (mask > 0)] == 0).all())  # the KL, not an advantage, teaches them
    losses = [json.loads(line) for line in record.read_text().splitlines()]
    assert sum(r["candidate_rows"] for r in losses) == int((taught[index].float() * mask).sum())
    assert all(r["loss"] == "TopKDistillPPOLoss" and r["metrics"]["topk_kl"] >= 0 for r in losses)
    (metrics,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics["train/topk_kl"] > 0 and "opd/arithmetic/reverse_kl" in metrics
    assert "opd/countdown/reward" in metrics and "opd/countdown/reverse_kl" not in metrics


@pytest.mark.parametrize("topk, peak", [(0, 100), (8, 8)])
def test_the_loop_pulls_the_student_toward_a_peaked_teacher(tmp_path, ray_cluster, topk, peak):
    """The real loop's training signal, sampled estimate (topk 0) and top-k KL: a teacher that puts nearly all its
    mass on `peak` tokens after any prefix is several nats a token from a random student; ten OPD steps must cut the
    reverse KL the loop logs by 40% and raise the teacher's log-prob of the student's samples. The advantage's sign
    flipped (the KL rises) or the teacher's scores shifted by one token (it barely falls) fail it. (The sampled
    estimate needs tokens the student samples: a quarter of the vocabulary; the top-k KL needs the peak within k.)"""
    import json

    import yaml

    from slime_dsa.config import load_recipe
    from slime_dsa.orchestrator.train import run_training
    from tests.teacher_helpers import make_peaked_teacher

    student = make_expert(tmp_path / "student", seed=0)
    teacher = make_peaked_teacher(tmp_path / "teacher", student, tokens=list(range(100, 100 + peak)))
    recipe = {
        "model": {"path": str(student)}, "algorithm": {"name": "opd", "opd_topk": topk},
        "data": {"tasks": [{"kind": "arithmetic"}], "max_prompt_length": 128},
        "rollout": {"n_samples_per_prompt": 2, "prompts_per_step": 8, "max_response_length": 8, "temperature": 1.0},
        "trainer": {"num_steps": 10, "micro_batch_tokens": 2048, "learning_rate": 1e-2},
        "teachers": [{"name": "peaked", "path": str(teacher), "domains": ["arithmetic"]}],
        "cluster": {"num_cpus_per_actor": 0.5},
        "logging": {"wandb_mode": "disabled", "run_dir": str(tmp_path / "run"), "eval_every": 0},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run_dir = run_training(load_recipe(path))
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kl = [m["opd/arithmetic/reverse_kl"] for m in steps if "opd/arithmetic/reverse_kl" in m]
    score = [m["opd/arithmetic/teacher_logprob"] for m in steps if "opd/arithmetic/teacher_logprob" in m]
    logger.warning("peaked teacher, top-k %d: reverse KL per step %s; teacher log-prob %s", topk,
                   [round(x, 2) for x in kl], [round(x, 2) for x in score])
    assert len(kl) == 10 and kl[0] > 3.0
    assert sum(kl[-2:]) / 2 < 0.6 * kl[0]
    assert sum(score[-2:]) / 2 > score[0] + 0.3 * abs(score[0])
