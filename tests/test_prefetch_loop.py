"""rollout.prefetch_next_step end to end on CPU (a local Ray cluster, an embedded engine over HTTP): the next step's
first round sent during the train call trains on the same samples as without it, and no step before an evaluation,
a checkpoint or the end prefetches."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from slime_dsa.config import load_recipe

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

RECIPE = {
    "model": {"preset": "tiny"},
    "data": {"tasks": [{"kind": "arithmetic", "eval_size": 4, "reward_fn": "tests.plugins.rewards:digit_fraction"}],
             "apply_chat_template": True, "max_prompt_length": 96},
    "rollout": {"n_samples_per_prompt": 4, "prompts_per_step": 3, "max_response_length": 8},
    "trainer": {"num_steps": 5, "learning_rate": 3.0e-3, "micro_batch_tokens": 256},
    "logging": {"wandb_mode": "disabled", "eval_every": 2, "eval_at_start": False},
    "checkpoint": {"save_every": 0},
}


def _run(tmp_path, name, recipe):
    from slime_dsa.orchestrator.train import run_training

    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run_dir = run_training(load_recipe(path, [f"logging.run_dir={tmp_path / name}"]))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_prefetched_step_trains_on_the_samples_it_would_have_drawn(tmp_path, ray_cluster):
    plain = _run(tmp_path, "plain", RECIPE)
    ahead_recipe = json.loads(json.dumps(RECIPE))
    ahead_recipe["rollout"]["prefetch_next_step"] = True
    ahead = _run(tmp_path, "ahead", ahead_recipe)
    assert [r["step"] for r in ahead] == [r["step"] for r in plain] == [1, 2, 3, 4, 5]
    # step 1 has none before it; steps 2 and 4 evaluate after them, so steps 3 and 5 are not prefetched
    assert [r["perf/rollout_prefetched"] for r in ahead] == [0, 1, 0, 1, 0]
    assert all(r["perf/rollout_prefetched"] == 0 for r in plain)
    for a, p in zip(ahead, plain):
        keys = {k for k in p if not k.startswith("perf/")} - {"time", "elapsed_s"}
        assert keys == {k for k in a if not k.startswith("perf/")} - {"time", "elapsed_s"}
        for key in sorted(keys):
            if key.startswith("train/"):  # π_roll enters every train metric: within the engine's ~1e-7 noise
                assert math.isclose(a[key], p[key], rel_tol=1e-5, abs_tol=1e-6), (key, a[key], p[key])
            else:  # same prompts, seeds, tokens, rewards and evaluations
                assert a[key] == p[key], (key, a[key], p[key])
        # generated under the weights of their own step, as without the prefetch: the trainer's log-probs agree
        assert a["train/train_rollout_logprob_abs_diff"] < 1e-5


def test_a_step_after_a_train_call_and_push_too_long_for_the_timeout_does_not_prefetch(tmp_path, ray_cluster,
                                                                                        monkeypatch, caplog):
    import asyncio
    import logging

    import slime_dsa.orchestrator.train as train

    real_sync = train.sync_weights

    # a fake slow push: the real one 10.5 s late, once. The 20 s timeout leaves the other steps' train calls and pushes
    # 10 s, which a loaded two-core CI machine needs (one took over 3 s there)
    async def slow_first_push(weights, version, **kwargs):
        if version != 1:
            return await real_sync(weights, version, **kwargs)
        await asyncio.sleep(10.5)
        return 10.5 + await real_sync(weights, version, **kwargs)

    monkeypatch.setattr(train, "sync_weights", slow_first_push)
    recipe = json.loads(json.dumps(RECIPE))
    recipe["rollout"].update(prefetch_next_step=True, request_timeout_s=20.0)
    recipe["trainer"]["num_steps"] = 4
    recipe["logging"]["eval_every"] = 0
    with caplog.at_level(logging.WARNING, logger=train.logger.name):
        rows = _run(tmp_path, "slow", recipe)
    # step 1's train call and push took over half of the 20 s timeout: step 2's does not prefetch step 3's first round;
    # step 3's train call sends step 4's again
    assert [r["perf/rollout_prefetched"] for r in rows] == [0, 1, 0, 1]
    assert all(r["rollout/failed_samples"] == 0 for r in rows)  # the prefetched calls waited 10.5 s, within 20
    assert sum("prefetch_next_step held back" in m for m in caplog.messages) == 1
