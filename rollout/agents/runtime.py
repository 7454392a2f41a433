"""`AgentRuntime`: a task's agent loop, tools and limits, built once from the recipe, and one trajectory's run.

`run` never raises for what the loop or a tool does: an unexpected error fails that trajectory (status FAILED,
logged), never the rollout group or the run.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Any

from rollout.agents.base import AgentEnv, AgentLimits, AgentLoop
from rollout.agents.glm import GLMToolAgent
from rollout.tools.base import Tool
from rollout.tools.registry import load_tools
from rollout.tools.sandbox import SandboxLimits
from slime_dsa.config.errors import UserError
from slime_dsa.config.plugins import PluginError, import_object
from slime_dsa.data.sample import Sample, SampleStatus
from slime_dsa.data.tool_calls import ChatFormat

logger = logging.getLogger(__name__)

BUILTIN_LOOPS = {"glm": GLMToolAgent}


class AgentLoadError(UserError, ValueError):
    """An agent setting that does not give a working loop; the one-line message names it."""


def load_agent_loop(spec: str) -> AgentLoop:
    """The loop named `spec` (glm) or at the import path `spec` (a loop, or a class or function that makes one)."""
    if ":" not in spec:
        if spec not in BUILTIN_LOOPS:
            raise AgentLoadError(f"unknown agent loop {spec!r}; built-in: {', '.join(BUILTIN_LOOPS)}, or give "
                             "'package.module:attribute'")
        return BUILTIN_LOOPS[spec]()
    try:
        obj = import_object(spec, "agent loop")
        if isinstance(obj, type) or (not hasattr(obj, "run") and callable(obj)):
            obj = obj()
    except PluginError as e:
        raise AgentLoadError(str(e)) from e
    except (Exception, SystemExit) as e:
        raise AgentLoadError(f"agent loop {spec!r}: making it failed ({type(e).__name__}: {e})") from e
    if not callable(getattr(obj, "run", None)):
        raise AgentLoadError(f"agent loop {spec!r} is a {type(obj).__name__} without an async run(sample, env)")
    return obj


@dataclass
class AgentRuntime:
    """What every trajectory of one task shares."""

    loop: AgentLoop
    tools: dict[str, Tool]
    limits: AgentLimits
    format: ChatFormat
    tokenizer: Any

    @classmethod
    def build(cls, agent: Any, tokenizer: Any, max_response_length: int) -> AgentRuntime:
        """From a recipe's AgentConfig (data.tasks.<i>.agent); AgentLoadError / ToolLoadError name what fails."""
        try:
            chat_format = ChatFormat.from_tokenizer(tokenizer)
        except ValueError as e:
            raise AgentLoadError(f"agent: {e}") from e
        tools = load_tools(agent.tools, SandboxLimits.from_config(agent), agent.tool_isolation, agent.tool_workers)
        return cls(load_agent_loop(agent.loop), tools, AgentLimits.from_config(agent, max_response_length), chat_format,
                   tokenizer)

    async def run(self, sample: Sample, client: Any, sampling_params: dict[str, Any], *, seed: int,
                  session_id: str | None = None, indexer_topk: bool = False,
                  request_timeout_s: float = math.inf) -> Sample:
        """Play one trajectory of `sample` (fresh: prompt only)."""
        env = AgentEnv(client, self.tokenizer, self.format, self.tools, self.limits, dict(sampling_params), seed,
                       session_id, indexer_topk, request_timeout_s)
        try:
            return await self.loop.run(sample, env)
        except asyncio.CancelledError:
            raise
        except (Exception, SystemExit) as e:  # noqa: BLE001 - a broken trajectory costs that trajectory only
            logger.warning("sample %s: agent loop failed: %s: %s", sample.index, type(e).__name__, e, exc_info=True)
            sample.status = SampleStatus.FAILED
            sample.metadata["error"] = f"{type(e).__name__}: {e}"
            return sample
