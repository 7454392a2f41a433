"""Tools the tests and the robustness benchmark load by import path, as a user's plugin would be."""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

from rollout.tools.calculator import Calculator
from rollout.tools.search import Search
from rollout.tools.sandbox import SandboxLimits


# Code a misbehaving tool runs in the real sandbox: a SIGSEGV, a fork bomb, a 10 GB allocation.
SANDBOXED = {
    "crash": "import ctypes\nctypes.string_at(0)",
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "alloc_10gb": "blob = bytearray(10 * 1024**3)\nprint(len(blob))",
}


class Broken:
    """Fails in the way its `mode` says: raise, hang (past any deadline), block (its event loop, for BLOCK_S) or run
    SANDBOXED[mode] in the sandbox."""

    description = "A tool that always goes wrong."
    parameters: dict[str, Any] = {"type": "object", "properties": {"expression": {"type": "string"}}}

    def __init__(self, mode: str = "raise", name: str = "broken") -> None:
        self.mode, self.name = mode, name

    async def call(self, **arguments: Any) -> Any:
        return await misbehave(self.mode)


BLOCK_S = 4.0


async def misbehave(mode: str) -> Any:
    if mode == "raise":
        raise RuntimeError("the tool broke")
    if mode == "hang":
        await asyncio.sleep(3600)
    if mode == "block":  # the faulty plugin the docs warn about: it blocks its event loop instead of awaiting
        time.sleep(BLOCK_S)
        return "slept"
    from rollout.tools.python_tool import PythonTool

    return await PythonTool(SandboxLimits(wall_s=5)).call(SANDBOXED[mode])


class Faults:
    """Makes `fail_share` of a tool's calls (chosen by a hash of the call and a counter) misbehave in one of
    `fault_modes`, in equal shares; counts what it did in `modes` (shared by every flaky tool, for the report)."""

    fail_share = 0.10
    fault_modes: tuple[str, ...] = ("raise", "hang", "crash")
    modes: dict[str, int] = {"ok": 0}
    _calls = 0

    async def faulty(self, key: str) -> Any:
        """Misbehave for this call (raise, hang, or return the crashed sandbox's result), or return None."""
        Faults._calls += 1
        h = int(hashlib.sha256(f"{Faults._calls}:{key}".encode()).hexdigest(), 16)
        if h % 1000 >= self.fail_share * 1000:
            Faults.modes["ok"] += 1
            return None
        mode = self.fault_modes[h // 1000 % len(self.fault_modes)]
        Faults.modes[mode] = Faults.modes.get(mode, 0) + 1
        return await misbehave(mode)


class FlakyCalculator(Calculator, Faults):
    """The calculator, with Faults."""

    async def call(self, expression: str) -> Any:
        return await self.faulty(expression) or await super().call(expression)


class FlakySearch(Search, Faults):
    """The built-in search, with Faults."""

    async def call(self, query: str, k: str | int = 1) -> Any:
        return await self.faulty(query) or await super().call(query, k)


def hanging_calculator() -> Broken:
    return Broken("hang", name="calculator")


def broken_calculator_raise() -> Broken:
    return Broken("raise", name="calculator")


def broken_calculator_hang() -> Broken:
    return Broken("hang", name="calculator")


def broken_calculator_crash() -> Broken:
    return Broken("crash", name="calculator")


def broken_calculator_block() -> Broken:
    return Broken("block", name="calculator")


def blocking_tool() -> Broken:
    return Broken("block", name="blocking")


class Misbehaving:
    """A sync tool that, in whatever process runs it, does what `how` says: exit (os._exit), allocate (8 GiB, past
    any tool_memory_mb), sleep (past any deadline), print (4 MB), spin (CPU, past any tool_cpu_s), or pid (returns
    its process's id)."""

    name = "misbehaving"
    description = "A tool that goes wrong on request."
    parameters: dict[str, Any] = {"type": "object", "required": ["how"], "properties": {"how": {"type": "string"}}}

    def call(self, how: str) -> str:
        import os

        if how == "exit":
            os._exit(3)
        if how == "allocate":
            return str(len(bytearray(8 << 30)))
        if how == "sleep":
            time.sleep(3600)
        if how == "print":
            for _ in range(4096):
                print("x" * 1023)
        if how == "spin":
            while True:
                pass
        return str(os.getpid())


class Counting:
    """An async tool with state: how many times this instance was called, and in which process."""

    name = "counting"
    description = "Counts its calls."
    parameters: dict[str, Any] = {"type": "object", "properties": {}}

    def __init__(self) -> None:
        self.calls = 0

    async def call(self) -> str:
        import os

        await asyncio.sleep(0)
        self.calls += 1
        return f"{os.getpid()} {self.calls}"
