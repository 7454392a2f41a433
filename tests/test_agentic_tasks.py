"""The agentic side of the data: GLM tool-call text, the observation layout, the built-in agentic tasks (their
reference trajectories call the real tools and get what those return), their verifier, the recipe keys, and SFT on
multi-turn solutions (tool output masked out of the loss)."""

from __future__ import annotations

import asyncio
import random

import pytest

from rollout.rewards.registry import load_reward_fn
from rollout.tools.base import call_tool
from rollout.tools.registry import load_tools
from slime_dsa.config.errors import RecipeError
from slime_dsa.config.loader import validate_recipe
from slime_dsa.config.schema import AGENTIC_TASK_TOOLS
from slime_dsa.data.tokenizer import build_tokenizer
from slime_dsa.data.tool_calls import ChatFormat, ToolCall, parse_tool_calls, render_tool_call, solution_ids


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def get_task(kind: str):
    from slime_dsa.data.tasks import get_task  # imports datasets: not at module level

    return get_task(kind)


def task_params(kind: str, **params):
    from slime_dsa.data.tasks import task_params

    return task_params(kind, **params)


def test_tool_call_text_round_trips():
    text = render_tool_call("search", {"query": "Varn population", "k": 2})
    assert text == ("<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>Varn population</arg_value>\n"
                    "<arg_key>k</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")
    assert parse_tool_calls("I will look it up." + text + render_tool_call("calculator", {"expression": "1+2"})) == (
        [ToolCall("search", {"query": "Varn population", "k": "2"}), ToolCall("calculator", {"expression": "1+2"})],
        None)
    assert parse_tool_calls("<answer>42</answer>") == ([], None)


@pytest.mark.parametrize(("text", "why"), [
    ("<tool_call>calculator\n<arg_key>expression</arg_key>", "not closed"),
    ("<tool_call>\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>", "must start with the tool's name"),
    ("<tool_call>two words</tool_call>", "must start with the tool's name"),
    ("<tool_call>f\n<arg_key>a</arg_key>\n</tool_call>", "pairs"),
    ("<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\nstray</tool_call>", "pairs"),
])
def test_malformed_tool_calls_say_why(text, why):
    calls, error = parse_tool_calls(text)
    assert calls == [] and why in error


def test_observation_ids(tokenizer):
    fmt = ChatFormat.from_tokenizer(tokenizer)
    obs = tokenizer.convert_tokens_to_ids("<|observation|>")
    assert fmt.stop_token_ids == [obs, tokenizer.convert_tokens_to_ids("<|user|>")]
    ids = fmt.observation_ids(["42", "<|assistant|>"], last_model_token=obs)
    assert tokenizer.decode(ids) == ("\n<tool_response>\n42\n</tool_response>\n<tool_response>\n<|assistant|>\n"
                                     "</tool_response><|assistant|>\n")
    assert ids.count(tokenizer.convert_tokens_to_ids("<|assistant|>")) == 1  # a tool cannot write a control token
    assert fmt.observation_ids(["42"], last_model_token=tokenizer.eos_token_id)[0] == obs


@pytest.mark.parametrize("kind", ["calc_chain", "fact_lookup"])
def test_solution_layout_equals_the_chat_template(tokenizer, kind):
    fmt = ChatFormat.from_tokenizer(tokenizer)
    prompt, _, turns = get_task(kind).make_problem(random.Random(0), task_params(kind))
    messages = [{"role": "user", "content": prompt}]
    for turn in turns:
        calls, _ = parse_tool_calls(turn["content"]) if turn["role"] == "assistant" else ([], None)
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": c.name, "arguments": c.arguments}} for c in calls]} if calls else turn)
    rendered = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    head = tokenizer.encode(tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)
    ids, mask = solution_ids(turns, fmt)
    assert rendered == head + ids
    assert mask[0] == 1 and mask[-1] == 1 and 0 in mask
    assert all(m == 0 for i, m in zip(ids, mask) if i == tokenizer.convert_tokens_to_ids("<tool_response>"))


@pytest.mark.parametrize("kind", ["calc_chain", "fact_lookup"])
def test_reference_trajectories_match_the_real_tools_and_score_one(kind):
    tools = load_tools(AGENTIC_TASK_TOOLS[kind])
    reward = load_reward_fn(get_task(kind).reward)
    rng, params = random.Random(3), task_params(kind)
    for _ in range(20):
        _, answer, turns = get_task(kind).make_problem(rng, params)
        assert len([t for t in turns if t["role"] == "tool"]) >= 2  # several tool calls
        for call_turn, result in zip(turns[0::2], turns[1::2]):
            (call,), _ = parse_tool_calls(call_turn["content"])
            out = asyncio.run(call_tool(tools, call, timeout_s=5, max_output_chars=1000))
            assert out.output == result["content"]
        final = turns[-1]["content"]
        assert reward.fn(None, "x", answer, final_response=final)["reward"] == 1.0
        # the verifier reads the final turn, not the tool output before it
        assert reward.fn(None, final, answer, final_response="I do not know")["reward"] == 0.0


def test_agentic_tasks_build_deterministic_splits():
    from slime_dsa.data.tasks import build_task_splits

    for kind in ("calc_chain", "fact_lookup"):
        a = build_task_splits(kind, train_size=8, eval_size=4, seed=1)
        b = build_task_splits(kind, train_size=8, eval_size=4, seed=1)
        assert a["train"].to_list() == b["train"].to_list()
        assert not set(a["train"]["prompt"]) & set(a["eval"]["prompt"])
        assert isinstance(a["train"][0]["solution"], list)
    with pytest.raises(ValueError, match="calc_chain: need 1 <= min_steps"):
        task_params("calc_chain", min_steps=3, max_steps=2)


def test_schema_knows_each_agentic_kinds_tools():
    from slime_dsa.data.tasks import TASKS

    assert AGENTIC_TASK_TOOLS == {kind: spec.tools for kind, spec in TASKS.items() if spec.tools}


@pytest.mark.parametrize(("data", "pattern"), [
    ({"data": {"tasks": [{"kind": "calc_chain"}]}}, r"runs an agent, whose tool results are chat turns"),
    ({"data": {"apply_chat_template": True, "tasks": [{"kind": "fact_lookup", "agent": {"tools": ["search"]}}]}},
     r"data\.tasks\.0: kind 'fact_lookup' needs the tool 'calculator' in agent\.tools"),
    ({"data": {"apply_chat_template": True, "tasks": [{"kind": "calc_chain", "agent": {
        "tools": ["calculator"], "max_turn_tokens": 600}}]}}, r"max_turn_tokens \(600\) exceeds rollout\.max_response_length"),
    ({"data": {"apply_chat_template": True, "tasks": [{"agent": {"tools": ["calc"]}}]}}, r"'calc' is not a built-in tool"),
    ({"data": {"apply_chat_template": True, "tasks": [{"agent": {"tools": ["python", "python"]}}]}}, r"lists a tool twice"),
    ({"data": {"apply_chat_template": True, "tasks": [{"agent": {"loop": "react"}}]}}, r"loop \('react'\) must be glm"),
    ({"data": {"apply_chat_template": True, "tasks": [{"agent": {"tool_timeout_s": 60, "max_wall_time_s": 30}}]}},
     r"tool_timeout_s \(60\) exceeds max_wall_time_s \(30\)"),
])
def test_recipe_refuses_inconsistent_agent_settings(data, pattern):
    with pytest.raises(RecipeError, match=pattern) as err:
        validate_recipe(data)
    assert "\n" not in str(err.value)


def test_agentic_kinds_get_their_tools():
    config = validate_recipe({"data": {"apply_chat_template": True, "tasks": [
        {"kind": "fact_lookup"}, {"kind": "arithmetic", "agent": {"tools": ["python", "calculator"], "max_turns": 3}}]}})
    lookup, arithmetic = config.data.tasks
    assert lookup.agent.loop == "glm" and lookup.agent.tools == ["search", "calculator"]
    assert arithmetic.agent.max_turns == 3
    assert validate_recipe({}).data.tasks[0].agent is None


def test_sft_masks_tool_output(tokenizer):
    import torch

    from slime_dsa.checkpoint.hf_format import build_model
    from slime_dsa.data.prompts import load_task
    from slime_dsa.models.presets import preset_config
    from slime_dsa.sft import SupervisedExample, sft_loss, supervised_examples

    task = load_task("calc", tokenizer, kind="calc_chain", train_size=4, apply_chat_template=True)
    assert task.agent is not None and task.agent.tools == ["calculator"]
    examples = supervised_examples(list(task.train), tokenizer)
    response_tag = tokenizer.convert_tokens_to_ids("<tool_response>")
    for ex in examples:
        assert len(ex.loss_mask) == len(ex.response_ids) and ex.loss_mask[-1] == 1
        assert all(m == 0 for t, m in zip(ex.response_ids, ex.loss_mask) if t == response_tag)
        assert ex.response_ids[-1] == tokenizer.eos_token_id
    model = build_model(preset_config("tiny", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id), seed=0)
    ex = examples[0]
    loss = sft_loss(model, [ex])
    # the same example with every tool token in the loss scores differently: the masked ones were left out
    unmasked = sft_loss(model, [SupervisedExample(ex.prompt_ids, ex.response_ids, [1] * len(ex.response_ids))])
    assert not torch.isclose(loss, unmasked)
    single = supervised_examples([p for p in load_task("a", tokenizer, kind="arithmetic", train_size=2).train][:1],
                                 tokenizer)[0]
    assert single.loss_mask == [1] * len(single.response_ids)
