"""Tools by name: the built-in ones, or any given as "package.module:attribute" (a tool, or a class or function
that makes one with no arguments). The built-in python tool runs under the given sandbox limits (a recipe's
data.tasks.<i>.agent tool_* keys). Where a tool by import path runs is the agent's tool_isolation: `process` (the
default) runs its calls in worker processes under those limits (process_tool.ProcessTool, worker.py), `inline` on
the plugin loop of this process (base.PluginTool). Either way the tool is also made here once, for its name,
description and parameters (and at `recipe check`, to see that it loads): keep its constructor light.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from rollout.tools.base import PluginTool, Tool
from rollout.tools.plugin import ToolLoadError, make_tool
from rollout.tools.sandbox import SandboxLimits

__all__ = ["BUILTIN_TOOLS", "ToolIsolation", "ToolLoadError", "load_tool", "load_tools", "make_tool"]


def _calculator(sandbox: SandboxLimits | None = None) -> Tool:
    from rollout.tools.calculator import Calculator  # noqa: PLC0415

    return Calculator()


def _search(sandbox: SandboxLimits | None = None) -> Tool:
    from rollout.tools.search import Search  # noqa: PLC0415

    return Search()


def _python(sandbox: SandboxLimits | None = None) -> Tool:
    from rollout.tools.python_tool import PythonTool  # noqa: PLC0415

    return PythonTool(sandbox or SandboxLimits())


BUILTIN_TOOLS: dict[str, Callable[[SandboxLimits | None], Tool]] = {"calculator": _calculator, "search": _search,
                                                                   "python": _python}


ToolIsolation = Literal["process", "inline"]  # where the calls of a tool by import path run (module docstring)


def load_tool(spec: str, sandbox: SandboxLimits | None = None, isolation: ToolIsolation = "process",
              workers: int | None = None) -> Tool:
    """The tool named `spec` (built-in, the python tool under `sandbox`) or at the import path `spec`: a ProcessTool
    (its calls in `workers` worker processes under `sandbox`'s memory and CPU limits; None: TOOL_WORKERS) or, with
    isolation inline, a PluginTool."""
    if ":" not in spec:
        if spec not in BUILTIN_TOOLS:
            raise ToolLoadError(f"unknown tool {spec!r}; built-in tools: {', '.join(sorted(BUILTIN_TOOLS))}, or give "
                                "'package.module:attribute'")
        return BUILTIN_TOOLS[spec](sandbox)
    tool = make_tool(spec)
    if isolation == "inline":
        return PluginTool(tool)
    from rollout.tools.process_tool import ProcessTool  # noqa: PLC0415

    return ProcessTool(tool, spec, sandbox or SandboxLimits(), workers)


def load_tools(specs: Sequence[str], sandbox: SandboxLimits | None = None, isolation: ToolIsolation = "process",
               workers: int | None = None) -> dict[str, Tool]:
    """{tool name: tool} for `specs` (load_tool); two tools of one name are an error."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = load_tool(spec, sandbox, isolation, workers)
        if tool.name in tools:
            raise ToolLoadError(f"two tools are named {tool.name!r} ({spec!r} and an earlier one)")
        tools[tool.name] = tool
    return tools
