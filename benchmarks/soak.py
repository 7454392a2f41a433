"""Soak: --concurrency rollouts in flight at once against two embedded engines for --duration-s, with a weight push
(pause → update → continue) every --push-every-s, recording the RSS of every process at the start and the end.

A rollout is what the RL loop runs: a group of the quickstart's arithmetic prompts sampled n times in one batched
/generate (rollout.groups.GroupRollout), then scored. The engines are `python -m rollout.server` processes on
127.0.0.1 with a per-run API key; nothing else is contacted. The run is bounded in time (--duration-s, at most
7200) and in count (--max-rollouts), and stops by itself; at the end it checks that both engines still answer
/health and give the greedy tokens they gave at the start.

    python benchmarks/soak.py --duration-s 1800 --concurrency 1000 --out benchmarks/soak_result.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import secrets
import subprocess
import sys
import time
from pathlib import Path

from trainers.process_group import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"  # the only address this script talks to
MAX_DURATION_S = 7200
logger = logging.getLogger("soak")


def rss_mib(pid: int) -> float | None:
    """Resident set size of `pid` in MiB (VmRSS), None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def children(pid: int) -> list[int]:
    """Every process below `pid` (reward workers, engines)."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            kids.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def start_engine(model_dir: Path, port: int, key: str, running: int, cache_tokens: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SLIME_DSA_API_KEY": key}
    cmd = [sys.executable, "-m", "rollout.server", "--model", str(model_dir), "--host", HOST, "--port", str(port),
           "--max-running-requests", str(running), "--max-cache-tokens", str(cache_tokens), "--log-level", "WARNING"]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


class Soak:
    """The driver: keeps `concurrency` samples in flight, pushes weights periodically, samples RSS."""

    def __init__(self, args: argparse.Namespace, engines: dict[str, subprocess.Popen], key: str) -> None:
        from rollout.client import EngineClient
        from rollout.groups import GroupRollout, SampleNumbering
        from slime_dsa.checkpoint import read_state_dict
        from slime_dsa.config import load_recipe
        from slime_dsa.data.prompts import TaskMixture, build_tasks
        from transformers import AutoTokenizer

        self.args, self.engines = args, engines
        recipe = load_recipe(ROOT / "recipes" / "quickstart.yaml", [f"rollout.max_concurrency={args.concurrency}",
                                                                     f"rollout.max_response_length={args.max_new_tokens}"])
        tokenizer = AutoTokenizer.from_pretrained(str(args.model))
        tasks = build_tasks(recipe.data, tokenizer)
        self.mixture, self.numbering = TaskMixture(tasks, seed=0), SampleNumbering()
        self.client = EngineClient(list(engines), api_key=key, max_inflight_per_engine=args.concurrency,
                                   timeout_s=600)
        self.rollout = GroupRollout(self.client, tasks, tokenizer, recipe.rollout)
        self.n = recipe.rollout.n_samples_per_prompt
        self.weights = read_state_dict(args.model)
        self.counts = {"groups": 0, "samples": 0, "failed_samples": 0, "aborted_samples": 0, "pushes": 0,
                       "tokens": 0}
        self.latencies: list[float] = []
        self.rss: list[dict] = []

    def sample_rss(self, label: str) -> dict:
        pids = {"driver": os.getpid(), **{f"engine {url}": p.pid for url, p in self.engines.items()}}
        for child in children(os.getpid()):
            if child not in pids.values():
                pids[f"child {child}"] = child
        row = {"t_s": round(time.monotonic() - self.start, 1), "label": label,
               **{name: rss_mib(pid) for name, pid in pids.items()}}
        self.rss.append(row)
        logger.info("rss %s", json.dumps(row))
        return row

    async def greedy(self) -> list[list[int]]:
        prompt = list(range(3, 30))
        params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        return [(await self.client.post_to(url, "/generate", {"input_ids": prompt, "sampling_params": params}))
                ["output_ids"] for url in self.engines]

    async def one_group(self) -> None:
        from slime_dsa.data.sample import SampleStatus

        prompt = next(self.mixture)
        started = time.perf_counter()
        group = await self.rollout.generate_group(self.numbering.new_group(prompt, self.n))
        self.latencies.append(time.perf_counter() - started)
        self.counts["groups"] += 1
        self.counts["samples"] += len(group)
        self.counts["failed_samples"] += sum(s.status == SampleStatus.FAILED for s in group)
        self.counts["aborted_samples"] += sum(s.status == SampleStatus.ABORTED for s in group)
        self.counts["tokens"] += sum(s.response_length for s in group)

    async def pusher(self, deadline: float) -> None:
        from slime_dsa.orchestrator.weight_sync.http import push_tensors

        version = 0
        while time.monotonic() + self.args.push_every_s < deadline:
            await asyncio.sleep(self.args.push_every_s)
            version += 1
            await push_tensors(self.client, self.weights, version, pause_mode="in_place")
            self.counts["pushes"] += 1

    async def run(self) -> dict:
        args = self.args
        self.start = time.monotonic()
        await self.client.wait_healthy(timeout_s=300)
        before = await self.greedy()
        self.sample_rss("start")
        deadline = self.start + min(args.duration_s, MAX_DURATION_S)
        groups_in_flight = max(1, args.concurrency // self.n)
        running: set[asyncio.Task] = set()
        pusher = asyncio.create_task(self.pusher(deadline))
        next_rss = self.start + args.rss_every_s
        while time.monotonic() < deadline and self.counts["samples"] < args.max_rollouts:
            while len(running) < groups_in_flight:
                task = asyncio.create_task(self.one_group())
                running.add(task)
                task.add_done_callback(running.discard)
            await asyncio.wait(set(running), timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            if time.monotonic() >= next_rss:
                self.sample_rss("during")
                next_rss += args.rss_every_s
        pusher.cancel()
        await asyncio.gather(pusher, return_exceptions=True)
        if running:
            await asyncio.wait(set(running), timeout=600)
        elapsed = time.monotonic() - self.start
        end = self.sample_rss("end")
        after = await self.greedy()
        healthy = [await self.client.get(url, "/health") is None for url in self.engines]
        await self.client.close()
        lat = sorted(self.latencies) or [0.0]
        return {"elapsed_s": round(elapsed, 1), **self.counts, "samples_per_s": round(self.counts["samples"] / elapsed, 1),
                "group_latency_p50_s": round(lat[len(lat) // 2], 3), "group_latency_p99_s": round(lat[int(len(lat) * 0.99)], 3),
                "rss_mib_start": self.rss[0], "rss_mib_end": end, "engines_healthy_at_end": all(healthy),
                "greedy_same_at_end": before == after}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "recipes" / "assets" / "quickstart-sft")
    parser.add_argument("--duration-s", type=float, default=1800.0)
    parser.add_argument("--concurrency", type=int, default=1000, help="samples in flight at once, over both engines")
    parser.add_argument("--max-rollouts", type=int, default=50_000_000, help="stop after this many samples")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--push-every-s", type=float, default=60.0)
    parser.add_argument("--rss-every-s", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=None, help="write the summary JSON here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    key = secrets.token_urlsafe(24)
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"soak-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    per_engine = -(-args.concurrency // 2)
    cache = max(4096, per_engine * 64)  # prompt (~30) + response rows per request, in whole 16-token blocks
    engines = {}
    for i in range(2):
        port = free_port()
        engines[f"http://{HOST}:{port}"] = start_engine(args.model, port, key, per_engine, cache, logs / f"engine{i}.log")
    try:
        summary = asyncio.run(Soak(args, engines, key).run())
    finally:
        for proc in engines.values():
            proc.terminate()
        for proc in engines.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    summary.update({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
                    "machine": platform.processor() or platform.machine(), "python": platform.python_version(),
                    "command": " ".join([Path(sys.executable).name, *sys.argv]), "engine_logs": str(logs)})
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if summary["engines_healthy_at_end"] and summary["greedy_same_at_end"] else 1


if __name__ == "__main__":
    sys.exit(main())
