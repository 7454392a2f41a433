"""What running a tool by import path in a worker process costs per call: the same tool (the calculator, by its
import path) called through call_tool with tool_isolation inline (the plugin loop of this process) and process
(worker processes, the default), one call at a time and `--concurrency` at once; calls per second and the ratio,
measured in the same run. Worker start-up is left out (a warm-up call first).

    PYTHONPATH=. python benchmarks/tool_isolation.py --calls 2000 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from rollout.tools.base import call_tool
from rollout.tools.process_tool import close_tool_pools
from rollout.tools.registry import load_tools
from slime_dsa.data.tool_calls import ToolCall

SPEC = "rollout.tools.calculator:Calculator"


async def rate(tools: dict, calls: int, concurrency: int) -> float:
    """Calls per second of `calls` calls, `concurrency` at a time."""
    call = ToolCall("calculator", {"expression": "6 * 7"})

    async def one() -> None:
        result = await call_tool(tools, call, timeout_s=30, max_output_chars=100)
        assert result.output == "42", result

    await one()  # warm-up: the workers start
    start = time.perf_counter()
    for _ in range(calls // concurrency):
        await asyncio.gather(*(one() for _ in range(concurrency)))
    return (calls // concurrency) * concurrency / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--workers", type=int, default=None, help="tool_workers (default: cores, at most 4)")
    args = parser.parse_args()
    rows = {}
    for isolation in ("inline", "process"):
        tools = load_tools([SPEC], isolation=isolation, workers=args.workers)
        rows[isolation] = {f"c{c}": round(asyncio.run(rate(tools, args.calls, c)), 1) for c in (1, args.concurrency)}
    close_tool_pools()
    for c in ("c1", f"c{args.concurrency}"):
        rows[f"inline/process {c}"] = round(rows["inline"][c] / rows["process"][c], 1)
    print(json.dumps(rows))
    print("| concurrency | inline calls/s | process calls/s | inline / process | process µs per call |")
    print("|---:|---:|---:|---:|---:|")
    for c in (1, args.concurrency):
        i, p = rows["inline"][f"c{c}"], rows["process"][f"c{c}"]
        print(f"| {c} | {i:.0f} | {p:.0f} | {i / p:.1f}x | {1e6 / p:.0f} |")


if __name__ == "__main__":
    main()
