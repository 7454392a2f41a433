"""Tools given by import path run in worker processes by default (data.tasks.<i>.agent.tool_isolation: process):
real spawned workers, no mocks. A tool that exits, allocates past tool_memory_mb, sleeps past the deadline, prints
megabytes or spins past tool_cpu_s costs its call (an error output with a status, logged), its worker is replaced
and the next call works; a tool's state lives per worker; `inline` runs it in this process as before."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from rollout.tools.base import PluginTool, call_tool
from rollout.tools import process_tool
from rollout.tools.process_tool import ProcessTool, close_tool_pools
from rollout.tools.registry import load_tool, load_tools
from rollout.tools.sandbox import SandboxLimits
from slime_dsa.config.schema import AgentConfig
from slime_dsa.data.tool_calls import ToolCall
from tests.test_cli import one_line_error

LIMITS = SandboxLimits(cpu_s=1, wall_s=2.0, memory_mb=128)


@pytest.fixture(autouse=True)
def _stop_workers():
    process_tool._failures.clear()  # each test's failures logged from its first: the log is throttled per tool name
    yield
    close_tool_pools()


def call(tools, name, timeout_s=30.0, **arguments):
    """A tool call; the default deadline leaves room for a worker's start on a loaded machine (tests of the deadline
    pass their own)."""
    coro = call_tool(tools, ToolCall(name, arguments), timeout_s=timeout_s, max_output_chars=300)
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_a_tool_by_import_path_runs_in_a_worker_unless_inline():
    assert AgentConfig().tool_isolation == "process"
    isolated = load_tools(["calculator", "tests.plugins.tools:Misbehaving"], LIMITS)
    assert isinstance(isolated["misbehaving"], ProcessTool) and not isinstance(isolated["calculator"], PluginTool)
    worker_pid = int(call(isolated, "misbehaving", how="pid").output)
    assert worker_pid != os.getpid()

    inline = load_tools(["tests.plugins.tools:Misbehaving", "tests.plugins.tools:Counting"], LIMITS, "inline")
    assert not isinstance(inline["misbehaving"], ProcessTool) and isinstance(inline["misbehaving"], PluginTool)
    assert int(call(inline, "misbehaving", how="pid").output) == os.getpid()  # a sync call, on the plugin loop
    assert call(inline, "counting").output == f"{os.getpid()} 1"
    assert inline["counting"].tool.calls == 1  # the driver's own object: state in this process, as before


@pytest.mark.parametrize(("how", "status", "says"), [
    ("exit", "crashed", "error: misbehaving ended its worker process (exit status 3); its worker process was replaced"),
    ("allocate", "crashed", "error: misbehaving ran out of memory (MemoryError past tool_memory_mb, 128 MiB)"),
    ("sleep", "timeout", "error: misbehaving timed out after 2s"),
    ("print", "crashed", "error: misbehaving printed more than 1048576 bytes; its worker process was replaced"),
    ("spin", "crashed", "error: misbehaving used more than tool_cpu_s (1 s of CPU)"),
])
def test_a_misbehaving_tool_costs_its_call_and_its_worker(how, status, says, caplog):
    tools = {"misbehaving": load_tool("tests.plugins.tools:Misbehaving", LIMITS, workers=1)}
    before = call(tools, "misbehaving", how="pid").output
    start = time.perf_counter()
    # spin: a wall-clock deadline well past the 1 s of CPU, so that a loaded machine (the spinning worker gets a
    # fraction of a core) still meets the CPU limit first
    timeout_s = 8.0 if how == "spin" else 2.0
    with caplog.at_level("WARNING", logger="rollout.tools.process_tool"):
        failed = call(tools, "misbehaving", timeout_s=timeout_s, how=how)
    assert time.perf_counter() - start < timeout_s + 3
    assert failed.status == status and failed.output.startswith(says), failed
    assert "tool misbehaving" in caplog.text  # logged
    after = call(tools, "misbehaving", how="pid")
    assert after.status == "ok" and after.output != before  # a fresh worker took the next call


def test_an_error_reads_the_same_in_a_worker_as_inline():
    outputs = [call(load_tools(["tests.plugins.tools:broken_calculator_raise"], LIMITS, isolation), "calculator",
                    expression="1").output for isolation in ("process", "inline")]
    assert outputs == ["error: calculator failed: RuntimeError: the tool broke"] * 2


def test_a_tools_state_lives_per_worker():
    tools = {"counting": load_tool("tests.plugins.tools:Counting", LIMITS, workers=2)}

    async def burst():
        return await asyncio.gather(*(call_tool(tools, ToolCall("counting", {}), timeout_s=10, max_output_chars=100)
                                      for _ in range(3)))

    seen: dict[str, list[int]] = {}
    for _ in range(3):
        for result in asyncio.run(burst()):
            pid, count = result.output.split()
            seen.setdefault(pid, []).append(int(count))
    assert os.getpid() not in map(int, seen) and sum(map(len, seen.values())) == 9
    for counts in seen.values():  # each worker's own tool object counts its own calls
        assert sorted(counts) == list(range(1, len(counts) + 1))
    close_tool_pools()  # fresh workers make the tool again
    assert call(tools, "counting").output.endswith(" 1")


def test_recipe_check_refuses_an_unknown_tool_isolation(capsys, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  tasks:\n"
                      "    - {kind: calc_chain, agent: {tools: [calculator], tool_isolation: thread}}\n")
    err = one_line_error(capsys, "recipe", "check", str(recipe))
    assert "data.tasks.0.agent.tool_isolation: expected one of 'process' or 'inline', got 'thread'" in err


DRIVER = """
import asyncio
from rollout.tools.base import call_tool
from rollout.tools.registry import load_tool
from rollout.tools.sandbox import SandboxLimits
from slime_dsa.data.tool_calls import ToolCall

async def main():
    tools = {"misbehaving": load_tool("tests.plugins.tools:Misbehaving", SandboxLimits(), workers=1)}
    pid = await call_tool(tools, ToolCall("misbehaving", {"how": "pid"}), timeout_s=30, max_output_chars=100)
    print(pid.output, flush=True)
    await call_tool(tools, ToolCall("misbehaving", {"how": "sleep"}), timeout_s=3600, max_output_chars=100)

asyncio.run(main())
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_a_worker_in_a_hung_call_ends_with_its_driver():
    """A driver killed (SIGKILL, the OOM killer) while a tool call hangs: the idle workers saw their pipe close and
    ended, but the one in the call lived on, orphaned, for as long as the call hung."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, env=env)
    worker = 0
    try:
        worker = int(driver.stdout.readline())
        time.sleep(1.0)  # the worker is in the hung call
        assert _alive(worker)
    finally:
        driver.kill()
        driver.wait()
    try:
        deadline = time.monotonic() + 5
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "the worker outlived its driver"
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)


def test_a_worker_killed_for_its_cpu_leaves_no_core_file(tmp_path, monkeypatch):
    """SIGXCPU (past tool_cpu_s) dumps core: where core files are on (ulimit -c), each such call left a core file of
    its worker, its whole address space, in the run's working directory (and writing it could outlast the call's
    deadline, so a CPU overrun read as a timeout)."""
    import resource  # noqa: PLC0415

    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (min(64 << 20, hard) if hard != resource.RLIM_INFINITY else 64 << 20,
                                              hard))
    monkeypatch.chdir(tmp_path)  # the workers start here
    try:
        tools = {"misbehaving": load_tool("tests.plugins.tools:Misbehaving", LIMITS, workers=1)}
        assert call(tools, "misbehaving", how="spin", timeout_s=10).status == "crashed"
    finally:
        resource.setrlimit(resource.RLIMIT_CORE, (soft, hard))
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("core")]
