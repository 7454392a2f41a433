"""`python -m rollout.server --model DIR [--host 127.0.0.1] [--port 30000] ...`: `slime-dsa serve` on its own."""

from __future__ import annotations

import argparse
import logging
import sys

from rollout.server.command import add_serve_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollout.server", description=__doc__)
    add_serve_arguments(parser)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from slime_dsa.config.errors import UserError  # noqa: PLC0415

    try:
        return run(args)
    except UserError as err:
        parser.error(str(err))


if __name__ == "__main__":
    sys.exit(main())
