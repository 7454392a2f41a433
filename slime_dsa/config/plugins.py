"""Plugins by import path: "package.module:attribute" (attribute paths like "mod:Cls.method" too)."""

from __future__ import annotations

import importlib
from typing import Any


class PluginError(ValueError):
    """An import path that does not resolve; the message names the path and what failed."""


def import_object(path: str, what: str = "plugin") -> Any:
    """The object at "package.module:attribute"; PluginError naming `what` and the path otherwise."""
    module_name, _, attr_path = path.partition(":") if isinstance(path, str) else ("", "", "")
    if not module_name or not attr_path or ":" in attr_path:
        raise PluginError(f"{what} {path!r} must look like 'package.module:attribute'")
    try:
        obj: Any = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # ImportError, any error the module raises, a script's sys.exit
        raise PluginError(f"{what} {path!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc})") from exc
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{what} {path!r}: {getattr(obj, '__name__', module_name)!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj
