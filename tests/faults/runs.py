"""What the fault tests share: a small real run (tiny model, embedded engines, FSDP over gloo), its records, and the
processes of this test session (engines found by the port they serve, never by name alone)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]


def recipe_dict(steps: int = 4, engines: int = 2, workers: int = 1, **overrides: Any) -> dict:
    """A run of `steps` GRPO steps that takes seconds a step on 2 cores."""
    recipe = {
        "model": {"preset": "tiny"},
        "data": {"tasks": [{"kind": "arithmetic", "eval_size": 8, "reward_fn": "tests.plugins.rewards:digit_fraction"}],
                 "apply_chat_template": True, "max_prompt_length": 96},
        "rollout": {"num_engines": engines, "n_samples_per_prompt": 4, "prompts_per_step": 4,
                    "max_response_length": 8},
        "trainer": {"num_workers": workers, "num_steps": steps, "learning_rate": 3.0e-3, "micro_batch_tokens": 256},
        "logging": {"eval_every": 0, "wandb_mode": "disabled"},
        "checkpoint": {"save_every": 1, "keep_last": 0},
    }
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split("__")
        node = recipe
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return recipe


def write_recipe(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe))
    return path


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(predicate, timeout_s: float, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False


def engine_urls(log: Path) -> list[str]:
    """The engine URLs a run's log announced ("N embedded engine(s) up: URL, URL")."""
    match = re.search(r"engine\(s\) up: (.+)", log.read_text()) if log.exists() else None
    return re.findall(r"https?://[\w.\-]+:\d+", match.group(1)) if match else []


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def pid_listening_on(port: int, among: set[int]) -> int | None:
    """The process of `among` that holds the listening socket of 127.0.0.1:`port`."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                inodes.add(fields[9])
    for pid in among:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return pid
        except OSError:
            continue
    return None


def processes_named(title: str, among: set[int]) -> list[int]:
    """Processes of `among` whose command line (a Ray worker's title) starts with `title`."""
    found = []
    for pid in sorted(among):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode().startswith(title):
                found.append(pid)
        except OSError:
            continue
    return found


def sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
