"""`python`: run a Python snippet in the sandbox (rollout/tools/sandbox.py) and return what it printed.

At most `max_concurrent` snippets run at once per tool (the others wait), so a burst of calls cannot fill the
machine with interpreters.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollout.tools.base import ToolResult
from rollout.tools.sandbox import SandboxLimits, run_python


class PythonTool:
    """The python tool."""

    name = "python"
    description = "Run a Python 3 script (standard library only, no network) and return what it prints."
    parameters: dict[str, Any] = {"type": "object", "required": ["code"],
                                  "properties": {"code": {"type": "string", "description": "the script"}}}

    def __init__(self, limits: SandboxLimits = SandboxLimits(), max_concurrent: int = 4) -> None:
        self.limits = limits
        self.slots = asyncio.Semaphore(max_concurrent)

    async def call(self, code: str) -> ToolResult:
        async with self.slots:
            result = await run_python(code, self.limits)
        if result.timed_out:
            return ToolResult(f"{result.output}\nerror: the script ran past {self.limits.wall_s:g}s and was killed",
                              "timeout")
        if result.truncated:
            return ToolResult(f"{result.output}\nerror: the script printed more than {self.limits.max_output_bytes} "
                              "bytes and was killed", "error")
        if result.signal:
            return ToolResult(f"{result.output}\nerror: the script died ({result.signal})", "crashed")
        if result.exit_code:
            return ToolResult(f"{result.output}\nerror: the script exited with status {result.exit_code}", "error")
        return ToolResult(result.output or "(no output)")
