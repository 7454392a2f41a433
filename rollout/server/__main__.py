"""`python -m rollout.server MODEL_DIR [--host 127.0.0.1] [--port 30000] ...`: serve one model directory."""

from __future__ import annotations

import argparse
import logging

from rollout.server.command import add_serve_arguments


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rollout.server", description=__doc__)
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="HF-format model directory")
    add_serve_arguments(parser)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rollout.server.launch import serve

    serve(args.model_dir, args.host, args.port, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
          max_prompt_tokens=args.max_prompt_tokens, max_cache_tokens=args.max_cache_tokens,
          max_running_requests=args.max_running_requests, dtype=args.dtype, device=args.device,
          served_model_name=args.served_model_name)


if __name__ == "__main__":
    main()
