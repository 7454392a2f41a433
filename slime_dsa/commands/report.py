"""`slime-dsa report RUN_DIR`: the run's main curves as PNG files."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("report", help="render a run's reward, loss and timing curves to PNG")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (holds metrics.jsonl)")
    parser.add_argument("--out", default=None, metavar="DIR", help="where to write the PNGs (default: RUN_DIR/report)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from slime_dsa.logging.report import render_report  # noqa: PLC0415

    for path in render_report(args.run_dir, args.out):
        print(path)
    return 0
