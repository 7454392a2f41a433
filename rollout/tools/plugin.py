"""A tool given by import path, made: what the driver (registry.load_tool) and each tool worker (worker.py) do with
"package.module:attribute"."""

from __future__ import annotations

from typing import Any

from rollout.tools.base import Tool
from slime_dsa.config.errors import UserError
from slime_dsa.config.plugins import PluginError, import_object


class ToolLoadError(UserError, ValueError):
    """A tool spec that does not give a tool; the one-line message names the spec."""


def make_tool(spec: str) -> Any:
    """The tool object at the import path `spec` (made by calling what is there, if it is a class or a function)."""
    try:
        obj = import_object(spec, "tool")
    except PluginError as e:
        raise ToolLoadError(str(e)) from e
    if isinstance(obj, type) or (not isinstance(obj, Tool) and callable(obj)):
        try:
            obj = obj()
        except (Exception, SystemExit) as e:
            raise ToolLoadError(f"tool {spec!r}: making it failed ({type(e).__name__}: {e})") from e
    if not isinstance(obj, Tool):
        raise ToolLoadError(f"tool {spec!r} is a {type(obj).__name__}, not a tool (name, description, parameters and "
                            "call(**arguments))")
    return obj
