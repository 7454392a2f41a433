"""Verifier of the built-in agentic tasks (calc_chain, fact_lookup): the final answer equals the expected number.

It reads the model's last turn (`final_response`, which the agent loop puts in the sample's metadata), not the whole
trajectory: a number inside a tool's output must not count as the model's answer. Metrics: the trajectory's turns
and tool calls.
"""

from __future__ import annotations

from typing import Any

from rollout.rewards.arithmetic import arithmetic_reward


def tool_answer_reward(sample: Any, response: str, answer: Any, final_response: str | None = None,
                       turns: int = 0, tool_calls: int = 0, **metadata: Any) -> dict[str, float]:
    """1.0 when the last turn's answer equals `answer` (an integer), else 0.0."""
    out = arithmetic_reward(sample, response if final_response is None else final_response, answer)
    return {**out, "turns": float(turns), "tool_calls": float(tool_calls)}
