"""Tools by name: the built-in ones, or any given as "package.module:attribute" (a tool, or a class or function
that makes one with no arguments; its calls run on the plugin loop: base.PluginTool). The built-in python tool runs
under the given sandbox limits (a recipe's data.tasks.<i>.agent tool_* keys)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rollout.tools.base import PluginTool, Tool
from rollout.tools.sandbox import SandboxLimits
from slime_dsa.config.errors import UserError
from slime_dsa.config.plugins import PluginError, import_object


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


class ToolLoadError(UserError, ValueError):
    """A tool spec that does not give a tool; the one-line message names the spec."""


def load_tool(spec: str, sandbox: SandboxLimits | None = None) -> Tool:
    """The tool named `spec` (built-in, the python tool under `sandbox`) or at the import path `spec` (a PluginTool)."""
    if ":" not in spec:
        if spec not in BUILTIN_TOOLS:
            raise ToolLoadError(f"unknown tool {spec!r}; built-in tools: {', '.join(sorted(BUILTIN_TOOLS))}, or give "
                                "'package.module:attribute'")
        return BUILTIN_TOOLS[spec](sandbox)
    try:
        obj = import_object(spec, "tool")
    except PluginError as e:
        raise ToolLoadError(str(e)) from e
    if isinstance(obj, type) or (not isinstance(obj, Tool) and callable(obj)):
        try:
            obj = obj()
        except Exception as e:
            raise ToolLoadError(f"tool {spec!r}: making it failed ({type(e).__name__}: {e})") from e
    if not isinstance(obj, Tool):
        raise ToolLoadError(f"tool {spec!r} is a {type(obj).__name__}, not a tool (name, description, parameters and "
                            "async call(**arguments))")
    return PluginTool(obj)


def load_tools(specs: Sequence[str], sandbox: SandboxLimits | None = None) -> dict[str, Tool]:
    """{tool name: tool} for `specs`; two tools of one name are an error."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = load_tool(spec, sandbox)
        if tool.name in tools:
            raise ToolLoadError(f"two tools are named {tool.name!r} ({spec!r} and an earlier one)")
        tools[tool.name] = tool
    return tools
