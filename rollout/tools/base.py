"""The tool seam: what a tool is, and `call_tool`, which turns any call into output for the model and never raises.

A tool is an object with `name`, `description`, `parameters` (a JSON schema of its arguments, as in OpenAI's tool
definitions) and `call(**arguments) -> str | ToolResult`, async (the built-in tools' way) or, for a tool given by
import path, sync. It may raise: an error, a timeout or a crash of the call becomes the call's output ("error:
..."), which the model reads like any other result. The built-in tools run on the rollout's loop and must not block
it (the python tool runs its scripts in the sandbox). Where a tool given by import path runs is its agent's
`tool_isolation`:
- `process` (the default): in worker processes under the agent's time, CPU and memory limits
  (rollout/tools/process_tool.py and worker.py): a crash, a hang, a memory blow-up or a flood of printing costs that
  call and its worker, which is replaced. A sync `call` runs in the worker's thread, an async one on the worker's
  own loop; a worker runs one call at a time, and the tool is made once per worker, so its state is per worker.
- `inline`: in this process, wrapped in a PluginTool whose calls run on the plugin loop in a helper thread
  (rollout/plugin_loop.py): one that blocks there (a sync `call` does, for its length) stalls the plugin calls
  running beside it until their deadlines ("timed out"), then that loop's thread is abandoned for a fresh one, and
  the rollout goes on. A crash or a memory blow-up takes the run with it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from rollout.plugin_loop import run_on_plugin_loop
from slime_dsa.data.tool_calls import ToolCall

logger = logging.getLogger(__name__)

ToolStatus = Literal["ok", "error", "timeout", "crashed"]


@dataclass(frozen=True)
class ToolResult:
    """What the model reads back from one call, and how the call ended (for metrics)."""

    output: str
    status: ToolStatus = "ok"


@runtime_checkable
class Tool(Protocol):
    """A callable tool; see the module docstring."""

    name: str
    description: str
    parameters: dict[str, Any]

    async def call(self, **arguments: Any) -> str | ToolResult: ...


class PluginTool:
    """A tool given by import path: the same tool (its attributes are the tool's), with its calls run on the plugin
    loop (module docstring: tool_isolation inline; process_tool.ProcessTool runs them in worker processes)."""

    def __init__(self, tool: Tool) -> None:
        self.tool = tool
        self.name, self.description, self.parameters = tool.name, tool.description, tool.parameters

    def __getattr__(self, attribute: str) -> Any:
        if attribute == "tool":  # not set yet (a copy being made)
            raise AttributeError(attribute)
        return getattr(self.tool, attribute)

    async def call(self, **arguments: Any) -> str | ToolResult:
        return await self.call_within(None, **arguments)

    async def call_within(self, timeout_s: float | None, **arguments: Any) -> str | ToolResult:
        """The call's output; PluginTimeout (a TimeoutError) past `timeout_s`."""
        return await run_on_plugin_loop(_called(self.tool, arguments), timeout_s, what=f"tool {self.name}")


async def _called(tool: Tool, arguments: dict[str, Any]) -> str | ToolResult:
    out = tool.call(**arguments)  # `call` itself is called here too: on the plugin loop
    return await out if inspect.isawaitable(out) else out


def tool_definition(tool: Tool) -> dict[str, Any]:
    """The OpenAI-style definition of `tool` (what a chat template's `tools` list takes)."""
    return {"type": "function",
            "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters}}


def check_arguments(tool: Tool, arguments: Mapping[str, Any]) -> str | None:
    """Why `arguments` do not fit the tool's schema (an unknown or a missing argument), or None."""
    properties = tool.parameters.get("properties", {})
    unknown = sorted(set(arguments) - set(properties))
    if unknown:
        return f"{tool.name} takes no argument {unknown[0]!r}; its arguments are {sorted(properties)}"
    missing = [k for k in tool.parameters.get("required", []) if k not in arguments]
    if missing:
        return f"{tool.name} needs the argument {missing[0]!r}"
    return None


def truncate(text: str, max_chars: int) -> str:
    """`text`, or its head and a note saying how many characters were cut, `max_chars` long at most."""
    if len(text) <= max_chars:
        return text
    kept = max(0, max_chars - len(f"\n... [{len(text)} more characters cut]"))
    return text[:kept] + f"\n... [{len(text) - kept} more characters cut]"


async def call_tool(tools: Mapping[str, Tool], call: ToolCall, *, timeout_s: float,
                    max_output_chars: int) -> ToolResult:
    """Run one call under a deadline; whatever happens becomes a ToolResult (cancellation alone propagates)."""
    tool = tools.get(call.name)
    if tool is None:
        return ToolResult(f"error: unknown tool {call.name!r}; the tools are {sorted(tools)}", "error")
    problem = check_arguments(tool, call.arguments)
    if problem:
        return ToolResult(f"error: {problem}", "error")
    try:
        if isinstance(tool, PluginTool):
            out = await tool.call_within(timeout_s, **call.arguments)
        else:
            out = await asyncio.wait_for(_contained(tool.call(**call.arguments)), timeout_s)
    except asyncio.TimeoutError:
        result = ToolResult(f"error: {call.name} timed out after {timeout_s:g}s", "timeout")
    except Exception as e:  # noqa: BLE001 - a failing tool costs its call only
        logger.debug("tool %s failed", call.name, exc_info=True)
        result = ToolResult(f"error: {call.name} failed: {type(e).__name__}: {e}", "error")
    else:
        result = out if isinstance(out, ToolResult) else ToolResult(str(out))
    return ToolResult(truncate(result.output, max_output_chars), result.status)


async def _contained(awaitable: Awaitable[Any]) -> Any:
    """`awaitable`'s result, with a SystemExit the tool raises turned into a RuntimeError inside the task that
    wait_for makes: a task re-raises a SystemExit out of the event loop, which would end the run."""
    try:
        return await awaitable
    except SystemExit as e:
        raise RuntimeError(f"raised SystemExit({e})") from None
