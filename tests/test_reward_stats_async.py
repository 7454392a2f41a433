"""Reward failures and timeouts are counted in the step whose window they end in, also when the asynchronous loop
resets the counters while a reward call is running (its rollout goes on during the step's tail)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace


def test_a_reward_call_running_at_a_reset_counts_after_it() -> None:
    from rollout.groups import GroupRollout, SampleNumbering
    from rollout.rewards.registry import RewardFunction
    from slime_dsa.config.schema import RolloutSection
    from slime_dsa.data.prompts import Prompt, Task
    from tests.fake_client import FakeClient

    def slow_failure(sample, response, answer, **metadata) -> float:
        time.sleep(0.2)
        raise RuntimeError("boom")

    prompt = Prompt(task="t", split="train", index=0, prompt_ids=[3, 4, 5], prompt_text="", answer="17")
    task = Task(name="t", kind="arithmetic", weight=1.0, reward_fn="arithmetic", train=[prompt], eval=None)
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
    groups = GroupRollout(FakeClient(vocab_size=20), [task], tokenizer, RolloutSection(max_response_length=4))
    groups.reward_fns["t"] = RewardFunction.wrap(slow_failure, isolation="thread")
    groups.inline_rewards["t"] = False
    (sample,) = SampleNumbering().new_group(prompt, 1)

    async def scenario() -> None:
        call = asyncio.create_task(groups._reward(sample))  # noqa: SLF001
        await asyncio.sleep(0.05)  # the call is running
        groups.reset_reward_stats()  # a step's collection ends (async_loop._collect)
        await call

    asyncio.run(scenario())
    assert sample.metadata["reward_failed"]
    assert groups.reward_metrics()["rollout/reward_failures"] == 1
