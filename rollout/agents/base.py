"""The agent seam: an agent loop turns a prompt into a trajectory of model turns and tool results, in ONE Sample.

An agent loop is any object with `async run(sample, env) -> Sample`. `env` (AgentEnv) gives it the client, the
tokenizer and its GLM chat format, the tools, the limits and the sampling options; `Trajectory`
(rollout/agents/trajectory.py) does the token bookkeeping that every loop needs, so a loop only decides what to do
between turns. The contract with the trainer (slime_dsa/data/sample.py): response_ids hold model tokens (loss_mask 1,
the engine's log-probs and weight versions) and tool tokens (loss_mask 0, log-prob 0.0, version -1) in order, never
re-tokenised; a trajectory cut by a limit is TRUNCATED with metadata["truncated_by"] in TRUNCATED_BY, and it always
ends with a model token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from rollout.tools.base import Tool
from slime_dsa.data.sample import Sample
from slime_dsa.data.tool_calls import ChatFormat

TruncatedBy = Literal["turns", "tokens", "wall_time"]
TRUNCATED_BY: tuple[str, ...] = ("turns", "tokens", "wall_time")


@dataclass(frozen=True)
class AgentLimits:
    """Limits of one trajectory (recipe: data.tasks.<i>.agent and rollout.max_response_length)."""

    max_turns: int = 8
    max_tokens: int = 512  # response tokens, model and tool together
    max_turn_tokens: int | None = None  # None = max_tokens
    max_wall_time_s: float = 300.0
    tool_timeout_s: float = 10.0
    max_tool_calls_per_turn: int = 4
    max_tool_output_chars: int = 1000

    @classmethod
    def from_config(cls, agent: Any, max_response_length: int) -> AgentLimits:
        """From a recipe's AgentConfig and rollout.max_response_length."""
        return cls(max_turns=agent.max_turns, max_tokens=max_response_length, max_turn_tokens=agent.max_turn_tokens,
                   max_wall_time_s=agent.max_wall_time_s, tool_timeout_s=agent.tool_timeout_s,
                   max_tool_calls_per_turn=agent.max_tool_calls_per_turn,
                   max_tool_output_chars=agent.max_tool_output_chars)


@dataclass
class AgentEnv:
    """What an agent loop may use for one trajectory."""

    client: Any  # a rollout.groups.GenerateClient: EngineClient, InProcessClient
    tokenizer: Any
    format: ChatFormat
    tools: Mapping[str, Tool]
    limits: AgentLimits
    sampling_params: dict[str, Any]  # temperature, top_p, top_k, stop; max_new_tokens and the seed are per turn
    seed: int  # the trajectory's sampling seed; turn k samples with a seed derived from (seed, k)
    session_id: str | None = None  # every turn goes to the engine that served the first (its prefix cache)
    return_indexer_topk: bool = False
    request_timeout_s: float = math.inf  # one turn's generation request


class AgentLoop(Protocol):
    """Plays one trajectory of `sample` (a fresh sample of the prompt) and returns it, finished."""

    async def run(self, sample: Sample, env: AgentEnv) -> Sample: ...
