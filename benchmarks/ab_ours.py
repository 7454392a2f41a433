"""Before against after on one GPU machine: the table of runs of ours alone (benchmarks/vs_trl_ours.py) from two trees,
alternated (gpu_single_device.sh's `abours` stage), over the steps that decode a short rollout.

A 64 x 16 countdown step's time depends on whether one answer ran to the token cap (a rollout of ~255 decode steps
instead of ~26), which falls on different steps in each run; so each run's figures are medians over its steps 2..N
whose rollout took fewer than --short-decode-steps decode steps, leaving out the profiled step and the one after it
(its trace is written between them) and the last (it reads the weights back for the benchmark's hook). NVML's busy
share of those steps too.

    python benchmarks/ab_ours.py $OUT/ab_new1 $OUT/ab_base1 $OUT/ab_base2 $OUT/ab_new2 --profiled 14
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

COLUMNS = [  # (header, perf key, scale)
    ("step s", "perf/step_time_s", 1.0),
    ("rollout s", "perf/rollout_time_s", 1.0),
    ("train s", "perf/train_time_s", 1.0),
    ("to_engines ms", "perf/rollout_wake_s", 1e3),
    ("sync ms", "perf/sync_time_s", 1e3),
    ("dispatch ms", "perf/trainer_dispatch_s", 1e3),
    ("decode step ms", "perf/engine_decode_step_ms", 1.0),
]


def short_steps(rows: list[dict], short_decode_steps: int, profiled: list[int]) -> list[dict]:
    """Steps 2..N-1 with a short rollout, without the profiled steps and the steps right after them (the last step
    reads the weights back for vs_trl.py's hook, in its sync)."""
    last = max((r["step"] for r in rows), default=0)
    skip = {s for p in profiled for s in (p, p + 1)} | {last}
    return [r for r in rows if r["step"] >= 2 and r["step"] not in skip
            and r.get("perf/engine_decode_steps", 0) < short_decode_steps]


def run_row(prefix: Path, short_decode_steps: int, profiled: list[int]) -> dict:
    """One run's medians from <prefix>_metrics.jsonl and <prefix>_result.json (NVML busy per step)."""
    rows = [json.loads(line) for line in Path(f"{prefix}_metrics.jsonl").read_text().splitlines() if line.strip()]
    result_path = Path(f"{prefix}_result.json")
    busy = json.loads(result_path.read_text()).get("gpu_busy_steps") if result_path.exists() else None
    short = short_steps(rows, short_decode_steps, profiled)
    out = {"run": prefix.name, "short_steps": len(short), "long_steps": sum(
        1 for r in rows if r["step"] >= 2 and r.get("perf/engine_decode_steps", 0) >= short_decode_steps)}
    for header, key, scale in COLUMNS:
        values = [r[key] * scale for r in short if key in r]
        out[header] = statistics.median(values) if values else None
    if busy:
        values = [busy[r["step"] - 1] for r in short if r["step"] - 1 < len(busy) and busy[r["step"] - 1] is not None]
        out["NVML busy %"] = statistics.median(values) if values else None
    return out


def table(rows: list[dict]) -> str:
    headers = ["run", "short_steps", "long_steps", *(h for h, _, _ in COLUMNS), "NVML busy %"]
    lines = ["| " + " | ".join(headers) + " |", "|---|" + "---:|" * (len(headers) - 1)]
    for row in rows:
        cells = [row["run"]]
        for h in headers[1:]:
            v = row.get(h)
            cells.append("-" if v is None else f"{v:.3f}" if isinstance(v, float) and v < 10 else f"{v:.1f}"
                         if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="prefixes: <prefix>_metrics.jsonl and <prefix>_result.json")
    parser.add_argument("--short-decode-steps", type=int, default=60)
    parser.add_argument("--profiled", type=int, nargs="*", default=[], help="profiled steps (left out with the next)")
    args = parser.parse_args(argv)
    text = table([run_row(Path(p), args.short_decode_steps, args.profiled) for p in args.runs])
    print(text)
    return text


if __name__ == "__main__":
    main()
