"""The asynchronous producer (slime_dsa.orchestrator.producer) and the run's rollout state, against a fake client:
groups pending at a save are regenerated exactly after a resume; aborted samples are requeued; the state's format
is the one checkpoints have always had."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tests.fake_client import FakeClient

TOKENIZER = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
STATE_KEYS = {"mixture", "next_sample_index", "next_group_id", "pending_groups", "keep_share"}


def _manager(client: FakeClient, n_samples: int = 2):
    from slime_dsa.config.schema import RolloutSection
    from slime_dsa.data.prompts import Prompt, Task, TaskMixture
    from slime_dsa.orchestrator.rollout_manager import RolloutManager

    prompts = [Prompt(task="t", split="train", index=i, prompt_ids=[3 + i, 4, 5], prompt_text=f"p{i}", answer="0")
               for i in range(40)]
    task = Task(name="t", kind="arithmetic", weight=1.0, reward_fn="arithmetic",  # inline: completion order is fixed
                train=prompts, eval=None)
    cfg = RolloutSection(n_samples_per_prompt=n_samples, prompts_per_step=2, max_response_length=3)
    return RolloutManager(client, [task], TaskMixture([task], seed=5), TOKENIZER, cfg, show_progress=False, seed=1)


async def _produce(manager, gate, groups: int, requeue_aborted: bool = True):
    """Run the producer until `groups` groups are buffered; returns the task (still running)."""
    producer = asyncio.ensure_future(manager.produce(gate, requeue_aborted=requeue_aborted))
    while len(manager.buffer) < groups:
        await asyncio.sleep(0.001)
    return producer


async def _stop(producer) -> None:
    producer.cancel()
    await asyncio.gather(producer, return_exceptions=True)


def test_a_resumed_producer_regenerates_the_pending_groups_exactly():
    from slime_dsa.orchestrator.buffer import StalenessGate

    async def first_run():
        client = FakeClient(held=["group-3"])  # group 3 is still in flight at the save
        manager = _manager(client)
        producer = await _produce(manager, StalenessGate(2, max_staleness=1), groups=3)
        (taken,) = await manager.buffer.get(1)  # the trainer took group 0
        state = manager.state_dict()
        buffered = manager.buffer.peek()
        await _stop(producer)
        return taken, buffered, state

    async def resumed(state):
        manager = _manager(FakeClient())
        manager.load_state_dict(state)
        assert manager.num_pending_replays == 3
        producer = await _produce(manager, StalenessGate(2, max_staleness=1), groups=4)
        await _stop(producer)
        return manager.buffer.drain(), manager

    taken, buffered, state = asyncio.run(first_run())
    assert set(state) == STATE_KEYS and state["next_sample_index"] == 8
    assert [(g["group_id"], g["first_index"], g["num_samples"]) for g in state["pending_groups"]] == \
        [(1, 2, 2), (2, 4, 2), (3, 6, 2)]
    again, manager = asyncio.run(resumed(state))
    again = {g[0].group_id: g for g in again}
    assert sorted(again) == [1, 2, 3, 4]  # the pending groups, then one fresh prompt
    for before in buffered:  # same prompts, indices and seeds: the same responses
        after = again[before[0].group_id]
        assert [(s.index, s.prompt_text, s.response_ids) for s in before] == \
            [(s.index, s.prompt_text, s.response_ids) for s in after]
    assert [s.index for s in again[3]] == [6, 7] and [s.index for s in again[4]] == [8, 9]
    prompts = [taken[0].prompt_text] + [again[g][0].prompt_text for g in (1, 2, 3, 4)]
    assert len(set(prompts)) == 5  # none lost, none used twice
    assert manager.produced_indices == list(range(2, 10)) and manager.num_pending_replays == 0


def test_aborted_samples_are_requeued_when_asked():
    from slime_dsa.orchestrator.buffer import StalenessGate

    async def main(requeue: bool):
        manager = _manager(FakeClient(abort_once=[1 * 1_000_003 + 1]), n_samples=3)  # sample 1's seed (seed 1)
        producer = await _produce(manager, StalenessGate(1, max_staleness=0), groups=1, requeue_aborted=requeue)
        await _stop(producer)
        (group,) = manager.buffer.drain()
        return group, manager

    group, manager = asyncio.run(main(requeue=True))
    assert [s.metadata.get("requeued") for s in group] == [None, 1, None]
    assert all(s.status.value == "truncated" for s in group) and manager.in_flight == {}
    group, _ = asyncio.run(main(requeue=False))
    assert [s.status.value for s in group] == ["truncated", "aborted", "truncated"]


def test_a_checkpoint_without_the_newer_keys_still_loads():
    """keep_share and pending_groups came later than the rest of the state: older checkpoints lack them."""
    manager = _manager(FakeClient())
    old = {k: v for k, v in manager.state_dict().items() if k in ("mixture", "next_sample_index", "next_group_id")}
    manager.load_state_dict({**old, "next_sample_index": 12, "next_group_id": 6})
    assert manager.collector.keep_share == 1.0 and manager.num_pending_replays == 0
    assert manager.state_dict()["next_sample_index"] == manager.numbering.next_sample_index == 12
    assert manager.evaluator.numbering is manager.numbering is manager.producer.numbering
