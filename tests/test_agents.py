"""Multi-turn agent rollouts against real embedded engines over real HTTP on 127.0.0.1, with real tools.

The model is tests/assets/agent-tiny, a tiny GLM-MoE-DSA model that memorised a few reference trajectories of the
agentic tasks (tests/agent_model.py), so greedy decoding on those prompts calls tools. Checked: token in, token out
across turns (on a trajectory whose ids the tokenizer would merge if its text were re-encoded), the layout equal to
SFT's, session affinity with prefix-cache hits, index replay over every row, the limits, failing tools, and GRPO
groups and evaluation through GroupRollout and Evaluator.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import numpy as np
import pytest

from rollout.agents.runtime import AgentRuntime
from rollout.client import EngineClient
from rollout.rewards.tool_answer import tool_answer_reward
from rollout.server.launch import EmbeddedServer, load_engine
from slime_dsa.config.schema import AgentConfig, RolloutSection
from slime_dsa.data.sample import NO_WEIGHT_VERSION, Sample, SampleStatus
from tests.agent_model import ASSET, memorised_prompts

GREEDY = {"temperature": 0.0}


class RecordingClient(EngineClient):
    """EngineClient that keeps every /generate it sent: (session, engine URL, input ids, response body)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str | None, str, list[int], Any]] = []

    async def request(self, path, payload, *, session_id=None, timeout_s=None, abort_rid=None):
        body, url = await super().request(path, payload, session_id=session_id, timeout_s=timeout_s,
                                          abort_rid=abort_rid)
        if path == "/generate":
            self.calls.append((session_id, url, list(payload["input_ids"]), body))
        return body, url


@pytest.fixture(scope="module")
def memorised():
    if not (ASSET / "model.safetensors").exists():
        pytest.fail(f"{ASSET} is missing: PYTHONPATH=. python -m tests.agent_model")
    return {m.name: m for m in memorised_prompts()}


@pytest.fixture(scope="module")
def tokenizer():
    from rollout.server.launch import load_tokenizer

    return load_tokenizer(ASSET)


@contextlib.asynccontextmanager
async def serving(n: int = 1, keep_indexer_topk: bool = False):
    """`n` embedded engines of the asset model behind HTTP, and a RecordingClient over them."""
    servers = []
    for _ in range(n):
        engine, tok = load_engine(ASSET, max_cache_tokens=32768, max_running_requests=64,
                                  keep_indexer_topk=keep_indexer_topk)
        servers.append(await EmbeddedServer.start(engine, tok))
    client = RecordingClient([s.url for s in servers])
    try:
        yield client
    finally:
        await client.close()
        for server in servers:
            await server.stop()


def runtime(tokenizer, max_tokens: int = 400, **agent: Any) -> AgentRuntime:
    return AgentRuntime.build(AgentConfig(**{"tools": ["calculator", "search"], **agent}), tokenizer, max_tokens)


def fresh(m, index: int = 0) -> Sample:
    return Sample(prompt_ids=list(m.example.prompt_ids), index=index, task=m.kind, answer=m.answer)


def run(coro, timeout: float = 300):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_token_in_token_out_across_turns(memorised, tokenizer):
    m = memorised["boundary"]

    async def scenario():
        async with serving() as client:
            out = await runtime(tokenizer).run(fresh(m), client, GREEDY, seed=1, session_id="s")
            return out, client.calls

    out, calls = run(scenario())
    assert out.status == SampleStatus.COMPLETED and out.metadata["turns"] == len(calls) >= 3
    # what the rollout produced is what SFT taught: same ids, same mask
    assert out.response_ids == m.example.response_ids and out.loss_mask == m.example.loss_mask
    assert tool_answer_reward(out, out.response_text, m.answer, **out.metadata)["reward"] == 1.0
    # every turn sent the whole sequence so far as ids: prompt, earlier model ids, tool ids
    sampled: list[int] = []
    for _, _, input_ids, body in calls:
        assert input_ids == out.tokens[: len(input_ids)]
        sampled += [int(t) for _, t, *_ in body["meta_info"]["output_token_logprobs"]]
    assert [t for t, keep in zip(out.response_ids, out.loss_mask) if keep] == sampled
    # the turn boundary: the model spelled "calculator" byte by byte; re-encoding the text would merge it
    second = calls[1][2]
    spelled = list(b"calculator")
    assert any(second[i : i + len(spelled)] == spelled for i in range(len(second)))
    assert tokenizer.encode(tokenizer.decode(second), add_special_tokens=False) != second
    # model tokens carry the engine's log-probs and versions; tool tokens 0.0 and -1
    engine_logprobs = [float(lp) for *_, body in calls for lp, *_ in body["meta_info"]["output_token_logprobs"]]
    assert [lp for lp, keep in zip(out.rollout_logprobs, out.loss_mask) if keep] == engine_logprobs
    tool = [(lp, v) for lp, v, keep in zip(out.rollout_logprobs, out.weight_versions, out.loss_mask) if not keep]
    assert tool and all(t == (0.0, NO_WEIGHT_VERSION) for t in tool)
    assert out.loss_mask[-1] == 1 and out.response_ids[-1] == tokenizer.eos_token_id


def test_session_affinity_reuses_the_prefix_cache(memorised, tokenizer):
    agent = runtime(tokenizer)

    async def scenario():
        async with serving(2) as client:
            jobs = [agent.run(fresh(m, i), client, GREEDY, seed=i, session_id=f"traj-{i}")
                    for i, m in enumerate(list(memorised.values()) * 2)]
            outs = await asyncio.gather(*jobs)
            info = [await client.get(url, "/get_server_info") for url in client.engines]
            return outs, client.calls, info

    outs, calls, info = run(scenario())
    assert all(o.status == SampleStatus.COMPLETED for o in outs)
    by_session: dict[str, list] = {}
    for session, url, input_ids, body in calls:
        by_session.setdefault(session, []).append((url, input_ids, body["meta_info"]["cached_tokens"]))
    assert len({url for turns in by_session.values() for url, *_ in turns}) == 2  # both engines served
    block = info[0]["block_size"]
    for turns in by_session.values():
        assert len({url for url, *_ in turns}) == 1  # every turn on the trajectory's engine
        for (_, before, _), (_, now, cached) in zip(turns, turns[1:]):
            # the earlier turns' full blocks came from the cache: only the new tail was prefilled
            assert cached >= len(before) // block * block
    assert all(i["stats_cached_tokens"] > 0 for i in info)


def test_index_replay_covers_every_row(memorised, tokenizer):
    m = memorised["lookup"]

    async def scenario():
        async with serving(1, keep_indexer_topk=True) as client:
            out = await runtime(tokenizer).run(fresh(m), client, GREEDY, seed=0, session_id="s", indexer_topk=True)
        async with serving(1, keep_indexer_topk=True) as fresh_client:  # an independent engine, one prefill
            whole = await fresh_client.generate(out.tokens, {"max_new_tokens": 1, "temperature": 0.0},
                                                return_indexer_topk=True, indexer_topk_start_len=0)
        return out, whole

    out, whole = run(scenario())
    from rollout.client import indexer_topk_rows

    assert out.status == SampleStatus.COMPLETED and out.metadata["turns"] >= 3
    out.validate()  # indexer_topk covers rows indexer_topk_start .. P+R-2: prompt, model and tool tokens
    topk, start = out.indexer_topk, out.topk_first_row
    assert len(topk) == out.total_length - 1 - start and start <= len(out.prompt_ids)
    reference, ref_start = indexer_topk_rows(whole["meta_info"])
    assert ref_start == start
    ref = reference[: len(topk)]
    same = np.mean([set(a.tolist()) == set(b.tolist()) for a, b in zip(topk.reshape(len(topk), -1), ref.reshape(len(ref), -1))])
    assert same >= 0.99, f"only {same:.3f} of the rows select the same keys as a one-pass prefill"


def test_limits_truncate_at_a_model_token(memorised, tokenizer):
    calc = memorised["calc1"]

    async def scenario():
        async with serving() as client:
            def play(agent, m=calc):
                return agent.run(fresh(m), client, GREEDY, seed=0, session_id=None)
            turns = await play(runtime(tokenizer, max_turns=2))
            turn_tokens = await play(runtime(tokenizer, max_turn_tokens=8))
            budget = await play(runtime(tokenizer, max_tokens=60))
            slow = await play(AgentRuntime.build(AgentConfig(tools=["tests.plugins.tools:hanging_calculator"],
                                                             tool_timeout_s=2.0, max_wall_time_s=2.0), tokenizer, 400))
            return turns, turn_tokens, budget, slow

    turns, turn_tokens, budget, slow = run(scenario())
    for sample, by, n_turns in ((turns, "turns", 2), (turn_tokens, "tokens", 1), (budget, "tokens", None),
                                (slow, "wall_time", 1)):
        assert sample.status == SampleStatus.TRUNCATED and sample.metadata["truncated_by"] == by, sample.metadata
        assert n_turns is None or sample.metadata["turns"] == n_turns
        assert sample.loss_mask[-1] == 1  # tool tokens after the last model turn were dropped
        sample.validate()
    assert len(budget.response_ids) <= 60 and len(turn_tokens.response_ids) == 8
    assert turns.response_ids == calc.example.response_ids[: len(turns.response_ids)]


@pytest.mark.parametrize("mode", ["raise", "hang", "crash", "block"])
def test_a_failing_tool_costs_only_its_call(memorised, tokenizer, mode, monkeypatch):
    """"block": a tool by import path whose async call blocks its event loop (time.sleep) runs on the plugin loop, so
    the engines (served on this test's loop) and the trajectory go on; each such call times out."""
    monkeypatch.setattr("rollout.plugin_loop.PROBE_S", 0.2)  # a blocked loop is told from a slow call sooner
    m = memorised["calc0"]
    agent = AgentRuntime.build(AgentConfig(tools=[f"tests.plugins.tools:broken_calculator_{mode}"], tool_timeout_s=1.0,
                                           max_turns=3), tokenizer, 200)

    async def scenario():
        async with serving() as client:
            return await agent.run(fresh(m), client, GREEDY, seed=0, session_id="s")

    out = run(scenario())
    assert out.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED), out.metadata
    assert out.metadata["tool_failures"] >= 1
    observed = tokenizer.decode([t for t, keep in zip(out.response_ids, out.loss_mask) if not keep])
    assert "error:" in observed


def test_grpo_groups_and_evaluation_run_trajectories(memorised, tokenizer):
    import datasets
    import torch

    from rollout.evaluation import Evaluator
    from rollout.groups import GroupRollout, SampleNumbering
    from slime_dsa.algorithms.advantages import group_advantages
    from slime_dsa.data.prompts import PromptSet, Task
    from slime_dsa.orchestrator.batching import build_train_batch

    calc = [m for m in memorised.values() if m.kind == "calc_chain" and m.name != "boundary"]
    rows = {"prompt": [m.prompt for m in calc], "answer": [m.answer for m in calc],
            "prompt_text": [tokenizer.decode(m.example.prompt_ids) for m in calc],
            "prompt_ids": [m.example.prompt_ids for m in calc], "source_row": list(range(len(calc)))}
    prompts = PromptSet("calc", "eval", datasets.Dataset.from_dict(rows))
    task = Task("calc", "calc_chain", 1.0, "tool_answer", prompts, prompts, agent=AgentConfig(tools=["calculator"]))
    cfg = RolloutSection(max_response_length=300, temperature=1.0)

    async def scenario():
        async with serving(2) as client:
            groups = GroupRollout(client, [task], tokenizer, cfg, seed=0)
            numbering = SampleNumbering()
            group = await groups.generate_group(numbering.new_group(prompts[0], 4))
            metrics = await Evaluator(client, [task], tokenizer, cfg, numbering, show_progress=False).evaluate()
            return group, metrics

    group, metrics = run(scenario())
    assert metrics["eval/calc/pass@1"] == 1.0  # greedy on memorised prompts
    assert len(group) == 4 and len({s.group_id for s in group}) == 1
    assert all(s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) and s.reward is not None for s in group)
    assert any(s.metadata["turns"] > 1 and 0 in s.loss_mask for s in group)  # multi-turn, tool tokens masked
    rewards = torch.tensor([s.reward for s in group])
    batch = build_train_batch(group, group_advantages(rewards, group_size=4))
    assert batch.loss_mask.sum() == sum(sum(s.loss_mask) for s in group)  # the trainer learns model tokens only
    assert batch.seqlens == [s.total_length for s in group]


def test_agent_loops_by_import_path(memorised, tokenizer):
    from rollout.agents.glm import GLMToolAgent
    from rollout.agents.runtime import load_agent_loop

    assert isinstance(load_agent_loop("glm"), GLMToolAgent)
    assert isinstance(load_agent_loop("rollout.agents.glm:GLMToolAgent"), GLMToolAgent)
    with pytest.raises(ValueError, match="unknown agent loop 'react'"):
        load_agent_loop("react")
    with pytest.raises(ValueError, match="without an async run"):
        load_agent_loop("tests.plugins.tools:__doc__")
    agent = AgentRuntime.build(AgentConfig(loop="tests.plugins.agents:OneTurn", tools=["calculator"]), tokenizer, 400)

    async def scenario():
        async with serving() as client:
            return await agent.run(fresh(memorised["calc0"]), client, GREEDY, seed=0)

    out = run(scenario())
    assert out.status == SampleStatus.COMPLETED and out.metadata["turns"] == 1 and all(out.loss_mask)
