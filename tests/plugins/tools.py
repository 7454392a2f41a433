"""Tools the tests and the robustness benchmark load by import path, as a user's plugin would be."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

from rollout.tools.calculator import Calculator
from rollout.tools.sandbox import SandboxLimits, run_python


class Broken:
    """Fails in the way its `mode` says: raise, hang (past any deadline) or crash (its sandboxed process segfaults)."""

    description = "A tool that always goes wrong."
    parameters: dict[str, Any] = {"type": "object", "properties": {"expression": {"type": "string"}}}

    def __init__(self, mode: str = "raise", name: str = "broken") -> None:
        self.mode, self.name = mode, name

    async def call(self, **arguments: Any) -> Any:
        return await misbehave(self.mode)


async def misbehave(mode: str) -> Any:
    if mode == "raise":
        raise RuntimeError("the tool broke")
    if mode == "hang":
        await asyncio.sleep(3600)
    from rollout.tools.python_tool import PythonTool

    return await PythonTool(SandboxLimits(wall_s=5)).call("import ctypes\nctypes.string_at(0)")  # a real SIGSEGV


class FlakyCalculator(Calculator):
    """The calculator, except that `fail_share` of its calls (chosen by a hash of the call and a counter) raise, hang
    or crash, a third each."""

    fail_share = 0.10

    def __init__(self) -> None:
        self.calls = 0
        self.modes: dict[str, int] = {"ok": 0, "raise": 0, "hang": 0, "crash": 0}

    async def call(self, expression: str) -> Any:
        self.calls += 1
        h = int(hashlib.sha256(f"{self.calls}:{expression}".encode()).hexdigest(), 16)
        if h % 1000 < self.fail_share * 1000:
            mode = ("raise", "hang", "crash")[h // 1000 % 3]
            self.modes[mode] += 1
            return await misbehave(mode)
        self.modes["ok"] += 1
        return await super().call(expression)


def hanging_calculator() -> Broken:
    return Broken("hang", name="calculator")


def broken_calculator_raise() -> Broken:
    return Broken("raise", name="calculator")


def broken_calculator_hang() -> Broken:
    return Broken("hang", name="calculator")


def broken_calculator_crash() -> Broken:
    return Broken("crash", name="calculator")
