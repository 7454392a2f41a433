"""`slime-dsa generate`: generate from prompts with a served engine (--url) or a model directory (--model).

Prompts come from --prompt (repeatable) or a JSONL file (--input) whose lines hold "prompt" (text),
"input_ids" or "messages" (chat). Results go to stdout or --output as JSONL, one line per prompt (a list of n
samples when --n > 1). With --model an embedded server starts on 127.0.0.1 inside this process, so both
ways run the same client code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from rollout.server.defaults import API_KEY_ENV


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `generate`."""
    parser = subparsers.add_parser("generate", help="generate from prompts (served engine or model directory)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--url", action="append", metavar="URL", help="engine URL (repeatable; routed)")
    source.add_argument("--model", metavar="DIR", help="HF-format model directory served in-process")
    parser.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)")
    parser.add_argument("--input", metavar="FILE", help="JSONL with prompt | input_ids | messages per line")
    parser.add_argument("--output", metavar="FILE", help="JSONL output file (default: stdout)")
    parser.add_argument("--chat", action="store_true", help="wrap --prompt texts as one user message each")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--seed", type=int, default=None, help="sampling_seed")
    parser.add_argument("--api-key", default=None,
                        help=f"Bearer key of the server (--url; default: ${API_KEY_ENV}, as `serve` reads it)")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    parser.add_argument("--device", default=None, help="with --model: cpu | cuda | cuda:N")
    parser.set_defaults(run=run)


def _read_prompts(args: argparse.Namespace) -> list[dict]:
    from slime_dsa.config.errors import UserError  # noqa: PLC0415

    items = [{"messages": [{"role": "user", "content": p}]} if args.chat else {"prompt": p} for p in args.prompt]
    if args.input:
        try:
            lines = open(args.input, encoding="utf-8").read().splitlines()
        except OSError as e:
            raise UserError(f"--input {args.input}: {e.strerror}") from None
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"--input {args.input} line {i} is not JSON: {e.msg}") from None
            if not isinstance(row, dict) or not {"prompt", "input_ids", "messages"} & set(row):
                raise UserError(f"--input {args.input} line {i} needs a prompt, input_ids or messages key")
            items.append(row)
    if not items:
        raise UserError("no prompts: give --prompt TEXT or --input FILE")
    return items


async def _generate_all(client, items: list[dict], args: argparse.Namespace, out) -> None:
    import asyncio  # noqa: PLC0415

    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
                "top_k": args.top_k, "n": args.n}
    if args.seed is not None:
        sampling["sampling_seed"] = args.seed
    gate = asyncio.Semaphore(args.concurrency)

    async def one(item: dict) -> dict:
        async with gate:
            if "messages" in item:
                body = {"messages": item["messages"], "max_tokens": args.max_new_tokens, "temperature": args.temperature,
                        "top_p": args.top_p, "n": args.n, **({"seed": args.seed} if args.seed is not None else {})}
                reply, _ = await client.request("/v1/chat/completions", body)
                return {**item, "choices": reply["choices"], "usage": reply["usage"]}
            payload = {"sampling_params": sampling, "return_logprob": False}
            payload["input_ids" if "input_ids" in item else "text"] = item.get("input_ids", item.get("prompt"))
            reply = await client.generate_raw(payload)
            return {**item, "output": reply}

    for result in await asyncio.gather(*(one(item) for item in items)):
        out.write(json.dumps(result, ensure_ascii=False) + "\n")


def run(args: argparse.Namespace) -> int:
    """Generate and write JSONL."""
    import asyncio  # noqa: PLC0415

    from pathlib import Path  # noqa: PLC0415

    from rollout.client import EngineClient, EngineRequestError, EngineUnavailableError  # noqa: PLC0415
    from rollout.server.command import check_device  # noqa: PLC0415
    from slime_dsa.config.errors import UserError  # noqa: PLC0415

    if args.model and not (Path(args.model) / "config.json").is_file():  # as `serve` says it
        raise UserError(f"--model {args.model} has no config.json: not an HF-format model directory")
    if args.concurrency < 1:  # else a ValueError traceback from the client (or a semaphore that never opens)
        raise UserError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.model:
        check_device(args.device, UserError)
    items = _read_prompts(args)
    try:  # before a model loads or a request goes out
        out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    except OSError as e:
        raise UserError(f"--output {args.output}: {e.strerror}") from None

    async def main() -> None:
        server = None
        urls = args.url
        if args.model:
            from rollout.server.launch import EmbeddedServer, load_checked_engine  # noqa: PLC0415

            engine, tokenizer = load_checked_engine(args.model, device=args.device)  # serve's checks, one line each
            server = await EmbeddedServer.start(engine, tokenizer, model_path=args.model)
            urls = [server.url]
        try:
            api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
            async with EngineClient(urls, api_key=api_key, max_inflight_per_engine=args.concurrency) as client:
                await _generate_all(client, items, args, out)
        except EngineRequestError as e:
            raise UserError(f"the engine refused a request: {e.message}") from None
        except EngineUnavailableError as e:  # --url that nothing answers at, or an engine that went away
            raise UserError(f"no engine answered: {e}") from None
        finally:
            if out is not sys.stdout:
                out.close()
            if server is not None:
                await server.stop()

    asyncio.run(main())
    return 0
