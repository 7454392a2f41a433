"""Tools: the calculator, BM25 search, the sandboxed Python executor (real subprocesses: limits that bite, no
network, a fork bomb or a 10 GB allocation costing only its own call), and call_tool turning any failure into output.
The sandbox tests keep their limits small: a 2-core machine shared with others must not feel them."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from rollout.tools.base import PluginTool, call_tool, truncate
from rollout.tools.calculator import Calculator, CalculatorError, evaluate, format_number
from rollout.tools.registry import ToolLoadError, load_tool, load_tools
from rollout.tools.sandbox import SandboxLimits, run_python, sandbox_mode
from slime_dsa.data.tool_calls import ToolCall

SMALL = SandboxLimits(cpu_s=2, wall_s=3.0, memory_mb=256, max_processes=6, max_output_bytes=4096)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))  # a hang fails in a minute, not at pytest's timeout


# ---- calculator --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("expression", "value"), [
    ("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"), ("-7 // 2", "-4"), ("10 / 4", "2.5"), ("10 / 5", "2"),
    ("2 ** 10", "1024"), ("17 % 5", "2"), ("123456789 * 987654321", "121932631112635269"), ("1 / 3", "0.333333333333"),
])
def test_calculator_values(expression, value):
    assert format_number(evaluate(expression)) == value


@pytest.mark.parametrize(("expression", "why"), [
    ("1 / 0", "division by zero"), ("2 ** 1000", "exponent"), ("__import__('os')", "unsupported element Call"),
    ("x + 1", "unsupported element Name"), ("1 +", "not an arithmetic expression"), ("9 ** 64 ** 2", "exponent"),
    ("10 ** 60 * 10 ** 60", "out of range"), ("1" * 600, "longer than"), ("'a' * 3", "unsupported element Constant"),
])
def test_calculator_refuses(expression, why):
    with pytest.raises(CalculatorError, match=why):
        evaluate(expression)


# ---- search ------------------------------------------------------------------------------------------------------

def test_search_finds_each_towns_document():
    from slime_dsa.data.facts import document, towns

    search = load_tool("search")
    for town in towns():
        assert search.search(f"{town.name} population") == [document(town)]
    assert len(search.search(f"{towns()[0].name} population", k=3)) == 3
    assert run(search.call(query="zzzz qqqq")) == "no document matches the query"


def test_search_over_a_given_corpus():
    from rollout.tools.search import Search

    search = Search(["the cat sat", "a dog ran far", "cats and dogs"])
    assert search.search("dog ran") == ["a dog ran far"]


# ---- call_tool ---------------------------------------------------------------------------------------------------

def test_call_tool_turns_failures_into_output():
    from tests.plugins.tools import Broken

    tools = {"calculator": Calculator(), "broken": Broken("raise"), "hang": Broken("hang", name="hang")}

    def call(name, **args):
        return run(call_tool(tools, ToolCall(name, args), timeout_s=0.5, max_output_chars=60))

    assert call("calculator", expression="6 * 7").output == "42"
    assert call("calculator", expression="1 / 0").output == "error: calculator failed: CalculatorError: division by zero"
    assert call("nope").output.startswith("error: unknown tool 'nope'")
    assert call("calculator", expr="1").output.startswith("error: calculator takes no argument 'expr'")
    assert call("calculator").output == "error: calculator needs the argument 'expression'"
    assert (call("broken").output, call("broken").status) == ("error: broken failed: RuntimeError: the tool broke",
                                                              "error")
    start = time.perf_counter()
    hung = call("hang")
    assert (hung.output, hung.status) == ("error: hang timed out after 0.5s", "timeout")
    assert time.perf_counter() - start < 2
    long = call("calculator", expression="7 ** 80")
    assert len(long.output) == 60 and "more characters cut" in long.output


def test_a_tool_that_exits_costs_its_call():
    """SystemExit is no Exception: a tool that raised it (sys.exit in a plugin) ended the driver's event loop."""
    from tests.plugins.tools import Broken

    class Exits(Broken):
        async def call(self, **arguments):
            raise SystemExit(3)

    tools = {"calculator": Calculator(), "exits": Exits(name="exits")}

    async def main():
        return await asyncio.gather(*(call_tool(tools, ToolCall(name, args), timeout_s=5, max_output_chars=200)
                                      for name, args in (("exits", {}), ("calculator", {"expression": "6 * 7"}))))

    exited, fine = run(main())
    assert (exited.output, exited.status) == ("error: exits failed: RuntimeError: raised SystemExit(3)", "error")
    assert fine.output == "42"


def test_a_plugin_tool_that_blocks_its_event_loop_costs_its_call(caplog):
    """A tool given by import path whose async call blocks (time.sleep, past its deadline) used to block the rollout's
    event loop, deadline and all: it runs on the plugin loop now, times out alone, and the stuck loop is replaced."""
    from rollout import plugin_loop
    from tests.plugins.tools import BLOCK_S

    # inline: this test is about the plugin loop (the default, tool_isolation process, runs them in workers)
    blocking = load_tool("tests.plugins.tools:blocking_tool", isolation="inline")
    tools = {"blocking": blocking, "calculator": Calculator(),
             "plugin_calculator": load_tool("rollout.tools.calculator:Calculator", isolation="inline")}
    assert blocking.mode == "block"  # a PluginTool reads as the tool it wraps
    abandoned = plugin_loop.abandoned_threads()

    async def main():
        ticks = 0

        async def tick():  # this loop (the rollout's) keeps running while the tool blocks
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        ticker = asyncio.create_task(tick())
        start = time.perf_counter()
        blocked = asyncio.create_task(call_tool(tools, ToolCall("blocking", {}), timeout_s=0.3, max_output_chars=200))
        await asyncio.sleep(0.1)
        beside = await asyncio.gather(call_tool(tools, ToolCall("calculator", {"expression": "6 * 7"}), timeout_s=5,
                                                max_output_chars=200),
                                      call_tool(tools, ToolCall("plugin_calculator", {"expression": "6 * 7"}),
                                                timeout_s=5, max_output_chars=200))  # waits for the fresh plugin loop
        blocked = await blocked
        after = await call_tool(tools, ToolCall("plugin_calculator", {"expression": "2 + 2"}), timeout_s=5,
                                max_output_chars=200)
        ticker.cancel()
        return blocked, beside, after, time.perf_counter() - start, ticks

    with caplog.at_level("WARNING", logger="rollout.plugin_loop"):
        blocked, beside, after, wall_s, ticks = run(main())
    assert (blocked.output, blocked.status) == ("error: blocking timed out after 0.3s", "timeout")
    assert [r.output for r in beside] == ["42", "42"] and after.output == "4"
    assert wall_s < BLOCK_S - 1 and ticks >= 10
    assert plugin_loop.abandoned_threads() == abandoned + 1
    assert "plugin loop stuck: tool blocking passed its 0.3s deadline" in caplog.text


def test_truncate_keeps_short_text():
    assert truncate("abc", 10) == "abc"
    cut = truncate("x" * 100, 40)
    assert len(cut) <= 40 and cut.endswith(f"[{100 - cut.index(chr(10))} more characters cut]")


def test_registry():
    assert sorted(load_tools(["calculator", "search"])) == ["calculator", "search"]
    assert load_tool("tests.plugins.tools:FlakyCalculator").name == "calculator"
    assert isinstance(load_tool("tests.plugins.tools:FlakyCalculator"), PluginTool)
    assert not isinstance(load_tool("calculator"), PluginTool)  # the built-in tools run on the rollout's loop
    with pytest.raises(ToolLoadError, match="unknown tool 'calc'; built-in tools: calculator, python, search"):
        load_tool("calc")
    with pytest.raises(ToolLoadError, match="two tools are named 'calculator'"):
        load_tools(["calculator", "tests.plugins.tools:FlakyCalculator"])
    with pytest.raises(ToolLoadError, match="making it failed"):
        load_tool("tests.plugins.tools:misbehave")
    with pytest.raises(ToolLoadError, match="is a str, not a tool"):
        load_tool("tests.plugins.tools:__doc__")


# ---- the sandbox -------------------------------------------------------------------------------------------------

def test_sandbox_runs_code_in_a_temporary_directory():
    result = run(run_python("import os, json\nprint(json.dumps(6 * 7))\nprint(os.getcwd())\nopen('f', 'w').write('x')",
                            SMALL))
    assert result.ok and result.output.splitlines()[0] == "42"
    workdir = result.output.splitlines()[1]
    assert "slime-sandbox-" in workdir and not os.path.exists(workdir)  # removed afterwards


def test_sandbox_reports_errors_and_exit_codes():
    result = run(run_python("raise ValueError('bad')", SMALL))
    assert result.exit_code == 1 and "ValueError: bad" in result.output
    assert run(run_python("import sys\nsys.exit(3)", SMALL)).exit_code == 3


def test_sandbox_memory_limit():
    start = time.perf_counter()
    result = run(run_python("x = bytearray(10 * 2**30)\nprint('allocated')", SMALL))
    assert "MemoryError" in result.output and "allocated" not in result.output
    assert time.perf_counter() - start < 5


def test_sandbox_limits_cannot_be_raised():
    result = run(run_python("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))", SMALL))
    assert result.exit_code == 1 and "ValueError" in result.output


def test_sandbox_fork_bomb_costs_only_its_call():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    start = time.perf_counter()
    result = run(run_python(bomb, SandboxLimits(cpu_s=2, wall_s=2.0, memory_mb=128, max_processes=6)))
    assert result.timed_out and time.perf_counter() - start < 4
    time.sleep(0.2)
    assert run(run_python("print('still fine')", SMALL)).output == "still fine\n"
    assert not _sandbox_processes()  # every fork died with the call


def test_sandbox_forks_are_limited():
    deadline = time.monotonic() + 5
    while _sandbox_processes() and time.monotonic() < deadline:  # an earlier test's processes may still be dying
        time.sleep(0.1)
    code = ("import os\nn = 0\nfor _ in range(50):\n    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
            "    if pid == 0:\n        import time; time.sleep(2); os._exit(0)\n    n += 1\nprint(n)")
    result = run(run_python(code, SMALL))
    assert int(result.output) <= SMALL.max_processes


def test_sandbox_has_no_network():
    code = "import socket\ns = socket.create_connection(('127.0.0.1', 22), timeout=1)\nprint('connected')"
    result = run(run_python(code, SMALL))
    assert "connected" not in result.output and result.exit_code == 1
    assert ("Network is unreachable" in result.output or "Connection refused" in result.output
            or "network access is disabled" in result.output)
    assert sandbox_mode() in ("netns", "socket-block")


def test_sandbox_cpu_wall_and_output_limits():
    cpu = run(run_python("while True:\n    pass", SandboxLimits(cpu_s=1, wall_s=5.0)))
    assert cpu.signal in ("SIGXCPU", "SIGKILL") and not cpu.timed_out
    sleep = run(run_python("import time\ntime.sleep(60)", SandboxLimits(wall_s=1.0)))
    assert sleep.timed_out and sleep.exit_code is None
    spam = run(run_python("while True:\n    print('x' * 1000)", SMALL))
    assert spam.truncated and len(spam.output) == SMALL.max_output_bytes
    # Megabyte writes fill the pipe's buffer before the kill: the pipe pauses, and its close must still be seen.
    flood = run(run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 1000000)", SMALL))
    assert flood.truncated and len(flood.output) == SMALL.max_output_bytes


def test_sandbox_crash_is_reported():
    result = run(run_python("import ctypes\nctypes.string_at(0)", SMALL))
    assert result.signal == "SIGSEGV"


def test_python_tool_output():
    from rollout.tools.python_tool import PythonTool

    tool = PythonTool(SMALL)
    assert run(tool.call(code="print(sum(range(10)))")).output == "45\n"
    crashed = run(tool.call(code="import ctypes\nctypes.string_at(0)"))
    assert crashed.status == "crashed" and "SIGSEGV" in crashed.output
    hung = run(tool.call(code="while True: pass"))
    assert hung.status in ("crashed", "timeout")


def _sandbox_processes() -> list[str]:
    """Processes still running the sandbox's bootstrap."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"slime-sandbox" in f.read() or b"RLIMIT_NPROC" in open(f"/proc/{pid}/cmdline", "rb").read():
                    found.append(pid)
        except OSError:
            pass
    return found


def test_the_python_tools_limits_are_the_recipes_agent_keys():
    """The python tool ran under fixed limits whatever the recipe said: 512 MiB, 5 CPU seconds, 8 processes, a 10 s
    wall (so a tool_timeout_s above 10 was cut at 10) and 8,192 bytes of output (so a max_tool_output_chars above it
    showed an error instead of the output)."""
    from rollout.agents.runtime import AgentRuntime
    from slime_dsa.config.schema import AgentConfig
    from slime_dsa.data.tokenizer import build_tokenizer

    agent = AgentConfig(tools=["python"], tool_timeout_s=20.0, tool_cpu_s=3, tool_memory_mb=96,
                        tool_max_processes=5, max_tool_output_chars=20_000)
    tools = AgentRuntime.build(agent, build_tokenizer(), 512).tools
    assert tools["python"].limits == SandboxLimits(cpu_s=3, wall_s=20.0, memory_mb=96, max_processes=5,
                                                   max_output_bytes=80_000)

    def call(code):
        return run(call_tool(tools, ToolCall("python", {"code": code}), timeout_s=agent.tool_timeout_s,
                             max_output_chars=agent.max_tool_output_chars))

    printed = call("print('x' * 15_000)")
    assert printed.status == "ok" and printed.output == "x" * 15_000 + "\n"
    allocated = call("blob = bytearray(200 * 2**20)\nprint('allocated')")  # the default 512 MiB would allow it
    assert allocated.status == "error" and "MemoryError" in allocated.output and "allocated" not in allocated.output
    assert AgentRuntime.build(AgentConfig(tools=["python"]), build_tokenizer(), 512).tools["python"].limits == \
        SandboxLimits()
