"""`slime-dsa export CHECKPOINT --out DIR`: a training checkpoint as an HF directory serving engines load."""

from __future__ import annotations

import argparse
from contextlib import nullcontext
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("export", help="write an HF directory (safetensors, config, tokenizer) from a checkpoint")
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a run's checkpoints/step_N directory")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="cast weights (default: as saved)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Export under the lock of --out (run_lock.OutputLock): a second export or conversion into it fails at once."""
    from rollout.progress import SampleProgress  # noqa: PLC0415
    from slime_dsa.checkpoint.training import export_checkpoint  # noqa: PLC0415
    from slime_dsa.durable import creation_problem  # noqa: PLC0415
    from slime_dsa.run_lock import OutputLock  # noqa: PLC0415

    out = Path(args.out)  # a --out that cannot be written takes no lock: export_checkpoint refuses it in its words
    lock = OutputLock(out, "--out") if not out.is_file() and creation_problem(out) is None else nullcontext()
    with lock, SampleProgress("exporting") as progress:  # on a terminal only: minutes of silence for a large model
        out = export_checkpoint(args.checkpoint, args.out, dtype=args.dtype, progress=progress)
    print(f"exported: {out}")
    return 0
