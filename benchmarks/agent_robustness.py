"""Robustness of agent rollouts: N concurrent multi-turn trajectories over 2 embedded engines while 10% of tool calls
fail, hang or crash. Counts the trajectories lost (an exception, or a FAILED sample: must be 0) and the wall time.

Engines: `python -m rollout.server` subprocesses on 127.0.0.1 serving tests/assets/agent-tiny, a tiny model that
memorised a few trajectories of the agentic tasks (tests/agent_model.py), sampled at temperature 1 so trajectories
differ. Tools: tests.plugins.tools:FlakyCalculator and FlakySearch, the built-in calculator and search except that a
`--fail-share` of all tool calls raise, hang past the tool deadline, or crash a sandboxed subprocess with SIGSEGV
(a third each).

    PYTHONPATH=. python benchmarks/agent_robustness.py --trajectories 1000 --out benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from trainers.process_group import free_port

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

logger = logging.getLogger("agent_robustness")


def start_engines(n: int, model: Path, log_dir: Path) -> list[tuple[subprocess.Popen, str]]:
    """`n` engine server subprocesses; (process, URL) each."""
    out = []
    for i in range(n):
        port = free_port()
        cmd = [sys.executable, "-m", "rollout.server", "--model", str(model), "--port", str(port),
               "--max-cache-tokens", "262144", "--max-running-requests", "512", "--log-level", "WARNING"]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        with open(log_dir / f"engine-{i}.log", "ab") as log:
            out.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env),
                        f"http://127.0.0.1:{port}"))
    return out


async def play(args: argparse.Namespace, urls: list[str]) -> dict:
    from rollout.agents.runtime import AgentRuntime
    from rollout.client import EngineClient
    from rollout.server.launch import load_tokenizer
    from slime_dsa.config.schema import AgentConfig
    from slime_dsa.data.sample import Sample, SampleStatus
    from tests.agent_model import memorised_prompts
    from tests.plugins.tools import Faults

    Faults.fail_share, Faults.fault_modes = args.fail_share, tuple(args.faults.split(","))
    tokenizer = load_tokenizer(args.model)
    agent = AgentRuntime.build(AgentConfig(tools=["tests.plugins.tools:FlakyCalculator",
                                                  "tests.plugins.tools:FlakySearch"], max_turns=6,
                                           max_turn_tokens=96, tool_timeout_s=args.tool_timeout_s,
                                           max_wall_time_s=args.wall_time_s,
                                           # inline: Faults' settings and counts are class attributes of this process
                                           tool_isolation="inline"), tokenizer, 400)
    prompts = memorised_prompts(tokenizer)
    async with EngineClient(urls, max_inflight_per_engine=1024, timeout_s=600) as client:
        await client.wait_healthy(timeout_s=300)
        samples = [Sample(prompt_ids=list(prompts[i % len(prompts)].example.prompt_ids), index=i,
                          task=prompts[i % len(prompts)].kind, answer=prompts[i % len(prompts)].answer)
                   for i in range(args.trajectories)]
        start = time.perf_counter()
        results = await asyncio.gather(*(
            agent.run(s, client, {"temperature": 1.0}, seed=s.index, session_id=f"traj-{s.index}")
            for s in samples), return_exceptions=True)
        wall = time.perf_counter() - start
        engine_stats = client.stats()
    done = [r for r in results if not isinstance(r, BaseException)]
    raised = [r for r in results if isinstance(r, BaseException)]
    status = Counter(s.status.value for s in done)
    calls = sum(s.metadata.get("tool_calls", 0) for s in done)
    return {
        "trajectories": args.trajectories, "engines": len(urls), "fail_share": args.fail_share, "faults": args.faults,
        "lost": len(raised) + status.get(SampleStatus.FAILED.value, 0), "raised": len(raised),
        "status": dict(status), "truncated_by": dict(Counter(s.metadata.get("truncated_by") for s in done
                                                              if s.status == SampleStatus.TRUNCATED)),
        "wall_s": round(wall, 1), "turns": sum(s.metadata.get("turns", 0) for s in done),
        "multi_turn": sum(s.metadata.get("turns", 0) > 1 for s in done),
        "tool_calls": calls, "tool_failures": sum(s.metadata.get("tool_failures", 0) for s in done),
        "injected": dict(Faults.modes), "response_tokens": sum(len(s.response_ids) for s in done),
        "engine_requests": {u: st["completed"] for u, st in engine_stats.items()},
        "errors": sorted({str(s.metadata.get("error")) for s in done if s.status == SampleStatus.FAILED})[:5]
                  + [repr(r) for r in raised[:5]],
    }


def markdown(result: dict, command: str) -> str:
    r = result
    injected = ", ".join(f"{k} {v}" for k, v in r["injected"].items())
    return "\n".join([
        "", f"### Agent rollouts under failing tools: {r['trajectories']} concurrent trajectories, {r['engines']} "
            "embedded engines", "",
        f"- date: {datetime.date.today()}; hardware: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores (shared); python {platform.python_version()}",
        f"- command: `{command}`",
        f"- model: tests/assets/agent-tiny (memorised trajectories of calc_chain and fact_lookup), temperature 1; "
        f"tools: calculator and BM25 search, {r['fail_share']:.0%} of all calls made to misbehave ({r['faults']}: "
        "raise, hang past the 2 s tool deadline, or run a SIGSEGV / fork bomb / 10 GB allocation in the sandbox); "
        "lost = an exception or a FAILED trajectory",
        "",
        "| trajectories | lost | wall s | completed / truncated | turns | multi-turn | tool calls | failed calls | "
        "injected faults |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---|",
        f"| {r['trajectories']} | {r['lost']} | {r['wall_s']} | {r['status'].get('completed', 0)} / "
        f"{r['status'].get('truncated', 0)} ({', '.join(f'{k} {v}' for k, v in r['truncated_by'].items())}) | "
        f"{r['turns']} | {r['multi_turn']} | {r['tool_calls']} | {r['tool_failures']} | {injected} |", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=1000)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--fail-share", type=float, default=0.10)
    parser.add_argument("--faults", default="raise,hang,crash",
                        help="how failing calls fail, in equal shares: raise, hang, crash, fork_bomb, alloc_10gb")
    parser.add_argument("--tool-timeout-s", type=float, default=2.0)
    parser.add_argument("--wall-time-s", type=float, default=900.0)
    parser.add_argument("--model", type=Path, default=REPO / "tests" / "assets" / "agent-tiny")
    parser.add_argument("--json", type=Path, help="write the numbers here as JSON")
    parser.add_argument("--out", type=Path, help="append a section to this markdown file (benchmarks/RESULTS.md)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("rollout.agents.trajectory").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as logs:
        engines = start_engines(args.engines, args.model, Path(logs))
        try:
            result = asyncio.run(play(args, [url for _, url in engines]))
        finally:
            for proc, _ in engines:
                proc.send_signal(signal.SIGTERM)
            for proc, _ in engines:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    logger.info("%s", json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.out:
        command = "PYTHONPATH=. python benchmarks/agent_robustness.py " + " ".join(sys.argv[1:])
        with args.out.open("a") as f:
            f.write(markdown(result, command))


if __name__ == "__main__":
    main()
