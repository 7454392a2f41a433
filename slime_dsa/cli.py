"""`slime-dsa`: the command line.

Each subcommand lives in a module listed in COMMANDS that defines `add_parser(subparsers)`, which registers
its parser and sets `run` (a function `run(args) -> int`) as a default. Those modules must import heavy
libraries (torch, ray) inside `run`, so that `--help` and `recipe check` answer at once.
Errors meant for the user (UserError) print as one line with exit code 2; other exceptions are bugs and
keep their traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
from collections.abc import Sequence

from slime_dsa import __version__, interrupts
from slime_dsa.config.errors import UserError

COMMANDS = (
    "slime_dsa.commands.recipe",  # recipe explain | check
    "rollout.server.command",  # serve
    "rollout.server.generate_command",  # generate
    "slime_dsa.commands.sft",  # sft
    "slime_dsa.commands.indexer_warmup",  # indexer-warmup
    "slime_dsa.commands.train",  # train
    "slime_dsa.commands.export",  # export
    "slime_dsa.commands.report",  # report
)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (argparse prints the usage block first)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every registered subcommand."""
    parser = _Parser(prog="slime-dsa", description="RL post-training for DeepSeek-Sparse-Attention models.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--log-level", default=None, choices=LOG_LEVELS,
                        help="level of log messages on stderr (default: WARNING for train, sft and indexer-warmup, "
                             "whose INFO goes to the run directory's log; INFO otherwise)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).add_parser(subparsers)
    for sub in _subcommand_parsers(parser):  # `slime-dsa train FILE --log-level INFO` works too
        sub.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS,
                         help="level of log messages on stderr (as slime-dsa --log-level)")
    return parser


def _subcommand_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every parser under `parser`'s subcommands, nested ones (recipe check) included."""
    found: list[argparse.ArgumentParser] = []
    for action in parser._actions:  # noqa: SLF001 (argparse keeps its subparsers nowhere else)
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                found += [sub, *_subcommand_parsers(sub)]
    return found


# Libraries whose INFO lines are about themselves, not the run (matplotlib's "generated new fontManager" on a first
# plot): WARNING and above only, unless --log-level DEBUG.
QUIET_LIBRARIES = ("matplotlib",)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (2 for a usage or recipe error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version and usage errors
        return exit_.code if isinstance(exit_.code, int) else 2
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 2
    level = args.log_level or getattr(args, "console_log_level", "INFO")
    root = logging.getLogger()
    before = list(root.handlers)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in root.handlers:
        if handler not in before:  # the console keeps its level when a run's log file lowers the root's to INFO
            handler.setLevel(level)
    if level != "DEBUG":
        for name in QUIET_LIBRARIES:
            logging.getLogger(name).setLevel(logging.WARNING)
    previous = _raise_on_sigterm()
    try:
        return int(args.run(args) or 0)
    except UserError as err:
        print(f"slime-dsa: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:  # a run's says which steps since its last checkpoint are lost
        print(f"slime-dsa: interrupted{f': {interrupt}' if str(interrupt) else ''}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `slime-dsa recipe explain | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's exit-time flush of stdout would raise again
        return 141
    finally:
        interrupts.reset()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _raise_on_sigterm():
    """SIGTERM (a scheduler's stop, `kill`) takes Ctrl-C's path: the run says what is lost and stops its engines and
    ranks, where the default action would end the process at once (slime_dsa/interrupts.py). Returns the handler it
    replaced."""
    try:
        return signal.signal(signal.SIGTERM, interrupts.terminate)
    except ValueError:  # not the main thread (an embedding program): leave its handlers alone
        return None


if __name__ == "__main__":
    sys.exit(main())
