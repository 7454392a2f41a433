"""What launching the engine's decode CUDA graph costs the host, on a GPU: `replay()` with the device idle and queued
behind earlier replays, and the graph's device time; the same for the step's sampling graph
(rollout/engine/sample_graph.py). Timed without a profiler: in a torch.profiler trace with kernel activities the same
launch showed ~0.8 ms (benchmarks/RESULTS.md, 2026-12-06).

    python benchmarks/decode_graph_launch.py --preset small --batch 1024

Prints one markdown table; --out appends it to a file. Needs a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_throughput as et  # noqa: E402
from rollout.engine import Engine, GenerateRequest, SamplingParams  # noqa: E402
from slime_dsa.checkpoint import build_model  # noqa: E402


def replay_host_ms(graph: torch.cuda.CUDAGraph, reps: int, idle: bool) -> float:
    """Median host time of replay(): after a device sync each time (`idle`), or back to back."""
    times = []
    torch.cuda.synchronize()
    for _ in range(reps):
        if idle:
            torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def replay_device_ms(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Device milliseconds a replay, over `reps` back to back."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / reps


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(et.PRESETS), default="small")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    config = et.model_config(args.preset)
    model = build_model(config, dtype=torch.bfloat16, device=torch.device("cuda"), seed=0).eval()
    prompts = et.make_prompts(args.batch, 32, config.vocab_size, seed=0)
    engine = Engine(model, max_cache_tokens=args.batch * 64, max_running_requests=args.batch, block_size=16, seed=0,
                    enable_prefix_caching=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerateRequest(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True, sampling_seed=i),
                                           return_logprob=True))
    while engine.has_work:
        engine.step()
    torch.cuda.synchronize()
    widths = sorted(w for b, w in engine.decoder._graphs if b == args.batch)
    decode = engine.decoder._graphs[(args.batch, widths[-1])].graph
    sampling = [g.graph for key, g in engine.decoder.sampling._graphs.items() if key[0] == args.batch]
    rows = [("decode forward", decode)] + [("sampling", g) for g in sampling[:1]]
    lines = [f"Decode graph launch, {torch.cuda.get_device_name()}, torch {torch.__version__}, preset {args.preset}, "
             f"batch {args.batch}, median of {args.reps}", "",
             "| graph | replay host ms, device idle | replay host ms, queued | device ms |", "|---|---:|---:|---:|"]
    for name, graph in rows:
        lines.append(f"| {name} | {replay_host_ms(graph, args.reps, idle=True):.3f} | "
                     f"{replay_host_ms(graph, args.reps, idle=False):.3f} | {replay_device_ms(graph, args.reps):.3f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return text


if __name__ == "__main__":
    main()
