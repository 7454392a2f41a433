"""DAPO dynamic sampling (slime_dsa.orchestrator.collection.StepCollector) against a real embedded server: rounds
sized by the share of groups the last round kept.

Three prompts in four always score 0 (their groups are dropped); the rest always have mixed rewards. With fixed
rounds the step needs many rounds and can end short; with adaptive rounds the second round asks for what the first
round's keep share says is needed, and the next step starts from that share.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tests.fake_client import FakeClient
from tests.hf_reference import make_hf_checkpoint

PROMPTS_PER_STEP, GROUP = 4, 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ds")
    make_hf_checkpoint(directory)
    return directory


def _run_steps(checkpoint, max_oversample_factor: float, steps: int = 2):
    from rollout.client import EngineClient
    from rollout.groups import GroupRollout, SampleNumbering
    from rollout.server.launch import EmbeddedServer, load_engine
    from slime_dsa.config.schema import RolloutSection
    from slime_dsa.data.prompts import Prompt, Task, TaskMixture
    from slime_dsa.orchestrator.collection import StepCollector

    prompts = [Prompt(task="t", split="train", index=i, prompt_ids=list(range(3 + i % 7, 9 + i % 7)), prompt_text="",
                      answer="mixed" if i % 4 == 0 else "zero") for i in range(400)]
    task = Task(name="t", kind="arithmetic", weight=1.0, reward_fn="tests.plugins.rewards:mixed_or_zero",
                train=prompts, eval=None)
    rollout = RolloutSection(n_samples_per_prompt=GROUP, prompts_per_step=PROMPTS_PER_STEP, max_response_length=2,
                             dynamic_sampling=True, max_oversample_factor=max_oversample_factor, max_sampling_tries=4)
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))

    async def main():
        engine, _ = load_engine(checkpoint, max_cache_tokens=4096)
        server = await EmbeddedServer.start(engine)
        client = EngineClient([server.url])
        mixture = TaskMixture([task])
        groups = GroupRollout(client, [task], tokenizer, rollout)
        collector = StepCollector(groups, mixture, SampleNumbering(), rollout, show_progress=False)
        drawn: list[list] = []
        take = mixture.take
        mixture.take = lambda n: drawn.append(take(n)) or drawn[-1]
        try:
            results = [await collector.collect() for _ in range(steps)]
        finally:
            await client.close()
            await server.stop()
        return results, drawn, collector

    return asyncio.run(main())


def test_adaptive_rounds_follow_the_keep_share(checkpoint):
    results, drawn, collector = _run_steps(checkpoint, max_oversample_factor=4.0)
    share, round_index = 1.0, 0
    for groups, metrics in results:
        kept = 0
        for _ in range(int(metrics["rollout/sampling_rounds"])):
            batch = drawn[round_index]
            need = PROMPTS_PER_STEP - kept
            assert len(batch) == max(need, min(round(need / share), 4 * need)), (round_index, share)
            usable = sum(p.answer == "mixed" for p in batch)
            share, kept, round_index = usable / len(batch), min(PROMPTS_PER_STEP, kept + usable), round_index + 1
        assert len(groups) == kept
        assert all(s.answer == "mixed" for g in groups for s in g)
    assert round_index == len(drawn)
    assert collector.keep_share == pytest.approx(share)


def test_a_resumed_run_sizes_its_next_round_from_the_saved_keep_share():
    from slime_dsa.config.schema import RolloutSection
    from slime_dsa.data.prompts import Prompt, Task, TaskMixture
    from slime_dsa.orchestrator.rollout_manager import RolloutManager

    task = Task(name="t", kind="arithmetic", weight=1.0, reward_fn="tests.plugins.rewards:mixed_or_zero",
                train=[Prompt(task="t", split="train", index=0, prompt_ids=[3], prompt_text="", answer=None)],
                eval=None)
    rollout = RolloutSection(dynamic_sampling=True)
    manager = RolloutManager(FakeClient(), [task], TaskMixture([task]), None, rollout, show_progress=False)
    manager.collector.keep_share = 0.25
    assert manager.state_dict()["keep_share"] == 0.25
    manager.load_state_dict({**manager.state_dict(), "keep_share": 0.5})
    assert manager.collector.keep_share == 0.5 and manager.collector.round_size(3) == 6


def test_fixed_rounds_draw_only_what_is_missing(checkpoint):
    results, drawn, _ = _run_steps(checkpoint, max_oversample_factor=1.0, steps=1)
    (groups, metrics), = results
    kept = 0
    for batch in drawn:
        assert len(batch) == PROMPTS_PER_STEP - kept
        kept = min(PROMPTS_PER_STEP, kept + sum(p.answer == "mixed" for p in batch))
    assert len(groups) == kept


def test_no_round_is_drawn_after_the_last_engine_is_lost(caplog):
    """Every engine gone (a replacement starts; the next step waits for it): the step's first round fails, and no
    further round burns prompts on a client with no engine. The samples' error names the lost engine."""
    from rollout.client import EngineClient
    from rollout.groups import GroupRollout, SampleNumbering
    from slime_dsa.config.schema import RolloutSection
    from slime_dsa.data.prompts import Prompt, Task, TaskMixture
    from slime_dsa.orchestrator.collection import StepCollector

    prompts = [Prompt(task="t", split="train", index=i, prompt_ids=[3, 4, 5], prompt_text="", answer="mixed")
               for i in range(100)]
    task = Task(name="t", kind="arithmetic", weight=1.0, reward_fn="tests.plugins.rewards:mixed_or_zero",
                train=prompts, eval=None)
    rollout = RolloutSection(n_samples_per_prompt=GROUP, prompts_per_step=PROMPTS_PER_STEP, max_response_length=2,
                             dynamic_sampling=True, max_sampling_tries=4)

    async def main():
        client = EngineClient(["http://127.0.0.1:9"])
        client.drop_engine("http://127.0.0.1:9", "its process died (ActorDiedError)")
        collector = StepCollector(GroupRollout(client, [task], None, rollout), TaskMixture([task]), SampleNumbering(),
                                  rollout, show_progress=False)
        try:
            return await collector.collect()
        finally:
            await client.close()

    groups, metrics = asyncio.run(main())
    assert groups == [] and metrics["rollout/sampling_rounds"] == 1
    assert metrics["rollout/failed_samples"] == metrics["rollout/num_samples"] == PROMPTS_PER_STEP * GROUP
    failures = [r.getMessage() for r in caplog.records if "generation failed" in r.getMessage()]
    assert len(failures) == PROMPTS_PER_STEP
    assert all("no engine left (1 dropped, the last http://127.0.0.1:9 (its process died" in m for m in failures)


def test_engines_that_fail_every_sample_end_the_round_and_then_the_run(checkpoint):
    """A real engine whose forward fails every time (FAULT INJECTED: a CUDA error that outlives its batch): each
    sample ends aborted with the engine's error, the step stops after its first round instead of drawing more, and
    the synchronous loop stops the run at the third such step in a row, naming the error."""
    from rollout.client import EngineClient
    from rollout.groups import GroupRollout, SampleNumbering
    from rollout.server.launch import EmbeddedServer, load_engine
    from slime_dsa.config.errors import UserError
    from slime_dsa.config.schema import RolloutSection
    from slime_dsa.data.prompts import Prompt, Task, TaskMixture
    from slime_dsa.orchestrator.collection import StepCollector
    from slime_dsa.orchestrator.train import FAILED_STEPS_LIMIT, check_failed_steps

    prompts = [Prompt(task="t", split="train", index=i, prompt_ids=[3 + i % 5, 4, 5], prompt_text="", answer="mixed")
               for i in range(100)]
    task = Task(name="t", kind="arithmetic", weight=1.0, reward_fn="tests.plugins.rewards:mixed_or_zero",
                train=prompts, eval=None)
    rollout = RolloutSection(n_samples_per_prompt=GROUP, prompts_per_step=PROMPTS_PER_STEP, max_response_length=2,
                             dynamic_sampling=True, max_sampling_tries=4)
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED (injected)")

    async def main():
        engine, _ = load_engine(checkpoint, max_cache_tokens=4096)
        engine.engine.model.forward_packed = broken  # the AsyncEngine's Engine
        server = await EmbeddedServer.start(engine)
        client = EngineClient([server.url])
        collector = StepCollector(GroupRollout(client, [task], tokenizer, rollout), TaskMixture([task]),
                                  SampleNumbering(), rollout, show_progress=False)
        try:
            return await collector.collect(), collector
        finally:
            await client.close()
            await server.stop()

    (groups, metrics), collector = asyncio.run(main())
    assert groups == [] and metrics["rollout/sampling_rounds"] == 1
    assert metrics["rollout/failed_samples"] == metrics["rollout/num_samples"] == PROMPTS_PER_STEP * GROUP
    assert "CUBLAS_STATUS_ALLOC_FAILED (injected)" in collector.last_error
    assert collector.keep_share == 1.0  # failures say nothing about how many groups' rewards agree

    run = SimpleNamespace(failed_steps=0, manager=SimpleNamespace(collector=collector))
    check_failed_steps(run, 1, metrics)
    check_failed_steps(run, 2, {**metrics, "rollout/failed_samples": metrics["rollout/num_samples"] - 1})
    assert run.failed_steps == 0  # one usable sample: the engines work
    for step in range(3, 3 + FAILED_STEPS_LIMIT - 1):
        check_failed_steps(run, step, metrics)
    with pytest.raises(UserError, match=r"steps 3-5: every sample failed .*CUBLAS_STATUS_ALLOC_FAILED \(injected\)"):
        check_failed_steps(run, 5, metrics)
