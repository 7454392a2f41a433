"""The asynchronous loop's collection of one step's groups (orchestrator/async_loop._collect)."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace

import pytest


def test_a_step_whose_groups_are_all_dropped_stops_instead_of_waiting_forever(monkeypatch):
    """With rollout.dynamic_sampling and a reward that is the same for every sample (a reward function that raises
    scores 0), the loop dropped each group and regenerated it without end: no step, no warning, prompts consumed."""
    from slime_dsa.config.errors import UserError
    from slime_dsa.config.schema import RecipeConfig
    from slime_dsa.data.sample import Sample, SampleStatus
    from slime_dsa.orchestrator import async_loop
    from slime_dsa.orchestrator.buffer import SampleBuffer, StalenessGate

    async def no_engine_check(run, version) -> None:
        return None

    monkeypatch.setattr(async_loop, "ensure_engines", no_engine_check)
    recipe = RecipeConfig.model_validate({"algorithm": {"name": "async_reinforce"},
                                          "rollout": {"prompts_per_step": 2, "n_samples_per_prompt": 2,
                                                      "dynamic_sampling": True}})
    buffer = SampleBuffer()
    manager = SimpleNamespace(buffer=buffer, min_group_size=2, in_flight={}, reset_reward_stats=lambda: None,
                              rollout_metrics=lambda taken, kept, counters, elapsed: {})
    run = SimpleNamespace(recipe=recipe, manager=manager)
    gate = StalenessGate(2, recipe.algorithm.max_staleness)

    async def uniform_rewards() -> None:  # every group's samples score the same
        group_id = 0
        while True:
            await gate.acquire()
            await buffer.put([Sample(prompt_ids=[1], response_ids=[2], loss_mask=[1], weight_versions=[0], reward=0.0,
                                     group_id=group_id, index=2 * group_id + k, status=SampleStatus.COMPLETED)
                              for k in range(2)])
            group_id += 1

    async def scenario() -> None:
        producer = asyncio.create_task(uniform_rewards())
        try:
            await asyncio.wait_for(async_loop._collect(run, gate, producer, version=0, totals=Counter(), since=0.0),
                                   timeout=5)
        finally:
            producer.cancel()

    with pytest.raises(UserError, match=r"step 1: \d+ groups could not be trained on and 0 of 2 could \(\d+ whose "
                                        r"rewards all agree, dropped by rollout\.dynamic_sampling"):
        asyncio.run(scenario())
