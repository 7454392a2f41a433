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
        self.limits, self.max_concurrent = limits, max_concurrent
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    def _semaphore(self) -> asyncio.Semaphore:
        """The running loop's semaphore (a tool may outlive a loop: SFT evaluates in a fresh one each time)."""
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:
            self._slots = (loop, asyncio.Semaphore(self.max_concurrent))
        return self._slots[1]

    async def call(self, code: str) -> ToolResult:
        async with self._semaphore():
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
