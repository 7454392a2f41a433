"""Evaluation (rollout.evaluation): one implementation for the RL loop and SFT. The same prompts get the same greedy
answers and eval/ metrics through the engines' HTTP client, through an InProcessClient over an embedded engine in
this process (SFT's path), and from the engine stepped by hand (what SFT's eval did before it shared this one)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from tests.hf_reference import make_hf_checkpoint

TOKENIZER = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("eval")
    make_hf_checkpoint(directory)
    return directory


def _tasks():
    """Two tasks of held-out prompts, scored by the parity of the last generated token."""
    from slime_dsa.data.prompts import Prompt, Task

    tasks = []
    for name, offset in (("a", 3), ("b", 40)):
        prompts = [Prompt(task=name, split="eval", index=i, prompt_ids=[offset + i, 7 + i, 11, 5 + 2 * i][: 2 + i % 3],
                          prompt_text="", answer=None) for i in range(5)]
        tasks.append(Task(name=name, kind="arithmetic", weight=1.0, reward_fn="tests.plugins.rewards:odd_last_token",
                          train=prompts, eval=prompts))
    return tasks


def _rollout():
    from slime_dsa.config.schema import RolloutSection

    return RolloutSection(max_response_length=MAX_NEW_TOKENS, return_indexer_topk=True)  # eval never asks for it


def test_eval_metrics_per_task_then_overall():
    from rollout.evaluation import eval_metrics

    metrics = eval_metrics({"a": [1.0, 0.0], "b": [0.5, 1.0, 1.0, 0.5]})
    assert list(metrics) == ["eval/a/reward_mean", "eval/a/pass@1", "eval/b/reward_mean", "eval/b/pass@1",
                             "eval/reward_mean", "eval/pass@1"]
    assert metrics["eval/a/pass@1"] == 0.5 and metrics["eval/b/reward_mean"] == 0.75
    assert metrics["eval/reward_mean"] == pytest.approx(4 / 6) and metrics["eval/pass@1"] == 0.5
    assert eval_metrics({}) == {}


def test_in_process_evaluation_equals_http_evaluation(checkpoint):
    from rollout.client import EngineClient, EngineRequestError
    from rollout.evaluation import Evaluator, eval_prompts
    from rollout.groups import GroupRollout, SampleNumbering
    from rollout.server.in_process import InProcessClient
    from rollout.server.launch import EmbeddedServer, load_engine

    tasks, cfg = _tasks(), _rollout()

    async def evaluate(client):
        metrics = await Evaluator(client, tasks, TOKENIZER, cfg, show_progress=False).evaluate(max_prompts=4)
        groups = GroupRollout(client, tasks, TOKENIZER, cfg, indexer_topk=False)
        numbering = SampleNumbering()
        samples = await asyncio.gather(*(groups.generate_group(numbering.new_group(p, 1), greedy=True)
                                         for p in eval_prompts(tasks, 4)))
        return metrics, [s for (s,) in samples]

    async def main():
        served, _ = load_engine(checkpoint, max_cache_tokens=4096)
        server = await EmbeddedServer.start(served)
        local, _ = load_engine(checkpoint, max_cache_tokens=4096)
        await local.start()
        try:
            async with EngineClient([server.url]) as client:
                over_http = await evaluate(client)
            in_process = InProcessClient(local, TOKENIZER)
            with pytest.raises(EngineRequestError, match="in-process engine answered 400: sampling_params.top_k"):
                await in_process.generate([3, 4], {"top_k": 0})
            return over_http, await evaluate(in_process)
        finally:
            await server.stop()
            await local.stop()

    (http_metrics, http_samples), (local_metrics, local_samples) = asyncio.run(main())
    assert local_metrics == http_metrics
    assert {"eval/a/pass@1", "eval/b/reward_mean", "eval/reward_mean", "eval/pass@1"} <= set(local_metrics)
    assert len(local_samples) == 8
    for a, b in zip(http_samples, local_samples):
        assert a.status.value in ("completed", "truncated") and a.status == b.status
        assert a.response_ids == b.response_ids and a.reward == b.reward
        assert a.rollout_logprobs == pytest.approx(b.rollout_logprobs, abs=1e-5)


def _rewards_stepped_by_hand(model, tasks, eos_token_ids=None) -> dict[str, list[float]]:
    """Each task's rewards of greedy answers from an Engine stepped by hand (parity of the last token)."""
    from rollout.engine import Engine, GenerateRequest, SamplingParams
    from rollout.evaluation import eval_prompts

    engine = Engine(model.eval(), max_cache_tokens=4096, eos_token_ids=eos_token_ids)
    prompts = eval_prompts(tasks, 3)
    for i, p in enumerate(prompts):
        sampling = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)
        engine.add_request(GenerateRequest(list(p.prompt_ids), sampling, rid=str(i)))
    answers: dict[str, list[int]] = {}
    while engine.has_work:
        answers.update({out.rid: out.output_ids for out in engine.step() if out.finish_reason is not None})
    rewards: dict[str, list[float]] = {}
    for i, p in enumerate(prompts):
        rewards.setdefault(p.task, []).append(float(bool(answers[str(i)]) and answers[str(i)][-1] % 2 == 1))
    return rewards


def test_sft_eval_answers_as_the_engine_stepped_by_hand(checkpoint):
    import slime_dsa
    from rollout.evaluation import eval_metrics
    from slime_dsa.sft import greedy_eval

    tasks = _tasks()
    model = slime_dsa.load_model(checkpoint)
    rewards = _rewards_stepped_by_hand(model, tasks)
    assert greedy_eval(model, TOKENIZER, tasks, 3, MAX_NEW_TOKENS) == eval_metrics(rewards)
    assert model.training  # handed back in training mode


def test_sft_eval_stops_on_generation_config_eos_ids(checkpoint, tmp_path):
    """sft's eval built its engine from the model alone, so it stopped on config.json's EOS ids only, where the
    run's engines (and SGLang) stop on generation_config.json's too: here every even id, which ends most answers."""
    import shutil

    import slime_dsa
    from rollout.evaluation import eval_metrics
    from slime_dsa.sft import greedy_eval

    shutil.copytree(checkpoint, model_dir := tmp_path / "model")
    model = slime_dsa.load_model(model_dir)
    even = list(range(2, model.config.vocab_size, 2))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": even}))
    tasks = _tasks()
    stopped = _rewards_stepped_by_hand(model, tasks, model.config.eos_token_ids + even)
    assert stopped != _rewards_stepped_by_hand(model, tasks)  # the extra ids change the answers
    assert greedy_eval(model, TOKENIZER, tasks, 3, MAX_NEW_TOKENS, model_dir=model_dir) == eval_metrics(stopped)
