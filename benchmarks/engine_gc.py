r"""Python's garbage collector in an engine's process over an RL loop's rollouts, with and without the full collection
the engine runs once paused (slime_dsa/gc_watch.py, AsyncEngine collect_when_paused), side by side on CPU.

Each side runs in a child process of its own (the collector's state is per process), in the order A B B A over
--rounds: an embedded engine with the model's forward replaced by zeros (rollout_call_host_time.py's, so the host
work is the real rollout path's: parsing, admission, steps, answers), and per RL step every group's call at once in
process (64 groups x 16 samples, answers of ~19 tokens: --lengths rl), then the colocated hand-over's pause, a sleep
for the trainer's step (--train-ms), and a continue. Per side: the collections Python started inside rollouts (all,
and the full ones with their longest pause), the rollouts' wall time, and the paused collections' time.

    PYTHONPATH=$PWD python benchmarks/engine_gc.py --steps 20 --rounds 2

FAKE: the forward (zeros), and the trainer (a sleep). No GPU: what it shows is when collections fall, not their
length on the H200's host.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import engine_throughput as et  # noqa: E402
import rollout_call_host_time as rc  # noqa: E402
from rollout.engine import AsyncEngine, Engine  # noqa: E402
from rollout.server.in_process import InProcessClient  # noqa: E402
from rollout_http_client import run as run_groups  # noqa: E402
from slime_dsa.checkpoint import build_model  # noqa: E402
from slime_dsa.models import ModelConfig  # noqa: E402

SIDES = ("paused_collection", "python_only")


class Collections:
    """Each collection's (generation, seconds, whether inside a rollout window)."""

    def __init__(self) -> None:
        self.records: list[tuple[int, float, bool]] = []
        self.in_rollout = False
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.records.append((info["generation"], time.perf_counter() - self._start, self.in_rollout))


async def one_side(collect_when_paused: bool, args: argparse.Namespace) -> dict:
    """args.steps RL steps' rollouts on one engine: the figures of one side."""
    torch.set_num_threads(1)
    overrides, prompt_len, new_tokens = rc.SHAPES["300m"]
    config = ModelConfig.from_dict({**et._COMMON, **et.PRESETS["tiny"][0], **overrides})
    model = build_model(config, dtype=torch.float32, device=torch.device("cpu"), seed=0).eval()
    rc.zero_forward(model)
    tokenizer = et.word_tokenizer(config.vocab_size)
    batch, group = args.prompts * args.group_size, args.group_size
    prompts = et.make_prompts(args.prompts, prompt_len, config.vocab_size, 0)
    need = sum(-(-(len(p) + new_tokens) // 16) for p in prompts) * group * 16
    engine = Engine(model, max_cache_tokens=need + 16, max_running_requests=batch, block_size=16, tokenizer=tokenizer,
                    keep_indexer_topk=False, overlap=True, seed=0)
    front = AsyncEngine(engine, collect_when_paused=collect_when_paused)
    await front.start()
    rc.cap_by_seed(front, rc.answer_lengths(batch, new_tokens, 0), batch)
    client = InProcessClient(front, tokenizer)
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop": ["</answer>"]}
    collections = Collections()
    gc.callbacks.append(collections)
    walls, paused = [], []
    try:
        for step in range(args.steps):
            groups = [[p, [{**params, "sampling_seed": step * batch + g * group + k} for k in range(group)]]
                      for g, p in enumerate(prompts)]
            spec = {"run": step, "groups": groups, "return_logprob": True, "replay": False, "form": "n"}
            collections.in_rollout = True
            done = await run_groups(spec, client)
            collections.in_rollout = False
            walls.append(done["wall_s"])
            del done
            before = engine.stats.get("gc_paused_s", 0.0)
            await front.pause("retract")  # the colocated hand-over to the trainer
            await asyncio.sleep(args.train_ms / 1e3)  # FAKE: the trainer's step
            await front.resume()  # a command behind the paused collection: it has run by now
            paused.append(engine.stats.get("gc_paused_s", 0.0) - before)
    finally:
        gc.callbacks.remove(collections)
        await front.stop()
    inside = [(g, s) for g, s, within in collections.records if within]
    full = [s for g, s in inside if g == 2]
    later = walls[1:] or walls
    return {"rollout_ms_median": statistics.median(later) * 1e3, "rollout_ms_max": max(later) * 1e3,
            "in_rollouts_gc_ms": sum(s for _, s in inside) * 1e3, "in_rollouts_full": len(full),
            "in_rollouts_full_ms_max": max(full, default=0.0) * 1e3,
            "paused_gc_ms_median": statistics.median(paused) * 1e3, "paused_gc_ms_max": max(paused) * 1e3,
            "steps": args.steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="RL steps (rollouts) per side and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of A B B A")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--train-ms", type=float, default=150.0, help="FAKE trainer step between rollouts")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(asyncio.run(one_side(args.child == SIDES[0], args))))
        return 0
    forwarded = [f"--steps={args.steps}", f"--prompts={args.prompts}", f"--group-size={args.group_size}",
                 f"--train-ms={args.train_ms}"]
    results: dict[str, list[dict]] = {side: [] for side in SIDES}
    for _ in range(args.rounds):
        for side in (SIDES[0], SIDES[1], SIDES[1], SIDES[0]):
            out = subprocess.run([sys.executable, __file__, f"--child={side}", *forwarded], check=True,
                                 capture_output=True, text=True).stdout
            results[side].append(json.loads(out.strip().splitlines()[-1]))
            print(side, results[side][-1], flush=True)
    print("| side | runs | rollout ms (median of medians) | GC in rollouts ms / run | full collections in "
          "rollouts / run | longest full in a rollout ms | paused collection ms (median) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for side, runs in results.items():
        print(f"| {side} | {len(runs)} | {statistics.median(r['rollout_ms_median'] for r in runs):.0f} | "
              f"{statistics.mean(r['in_rollouts_gc_ms'] for r in runs):.1f} | "
              f"{statistics.mean(r['in_rollouts_full'] for r in runs):.1f} | "
              f"{max(r['in_rollouts_full_ms_max'] for r in runs):.1f} | "
              f"{statistics.median(r['paused_gc_ms_median'] for r in runs):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
