"""`slime-dsa serve --model DIR`: serve a model directory over SGLang's HTTP protocol with the embedded engine."""

from __future__ import annotations

import argparse
import os



def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the embedded server (shared by `slime-dsa serve` and `python -m rollout.server`)."""
    from rollout.engine.defaults import (  # noqa: PLC0415
        DEFAULT_MAX_CACHE_TOKENS, DEFAULT_MAX_RUNNING_REQUESTS, INDEX_KEY_CACHE_DTYPES)
    from rollout.server.defaults import (  # noqa: PLC0415
        API_KEY_ENV, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_PORT)

    parser.add_argument("--model", required=True, metavar="DIR",
                        help="HF-format model directory (config.json + safetensors)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default %(default)s, SGLang's)")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, else none; an empty key "
                             "is refused)")
    parser.add_argument("--weight-dir", action="append", default=[], metavar="DIR",
                        help="a directory /update_weights_from_disk may load from (repeat for more; default: none, "
                             "so that endpoint loads nothing)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body outside weight updates (default %(default)s)")
    parser.add_argument("--max-prompt-tokens", type=int, default=DEFAULT_MAX_PROMPT_TOKENS,
                        help="longest prompt accepted (default %(default)s)")
    parser.add_argument("--max-cache-tokens", type=int, default=DEFAULT_MAX_CACHE_TOKENS,
                        help="KV cache size in tokens (default %(default)s)")
    parser.add_argument("--max-running-requests", type=int, default=DEFAULT_MAX_RUNNING_REQUESTS,
                        help="requests decoded at once (default %(default)s)")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available)")
    parser.add_argument("--served-model-name", default=None, help="the model name /v1 answers with")
    parser.add_argument("--keep-indexer-topk", action="store_true",
                        help="keep each cached row's DSA top-k next to its KV, so /generate can return the prompt rows' "
                             "selection too (indexer_topk_start_len >= 0; index replay). Costs full layers x "
                             "index_topk x 2 bytes per cache token")
    parser.add_argument("--overlap", action="store_true",
                        help="the engine's overlap scheduler: each step launches before the previous step's tokens "
                             "reach the host (checked on CPU; not yet measured on a GPU, so off by default)")
    parser.add_argument("--num-continuous-decode-steps", type=int, default=1, metavar="N",
                        help="decode steps a launch while every running request decodes, none streams and none is "
                             "within N tokens of its limit: the host schedules once for N tokens (SGLang's flag of "
                             "that name); the same tokens")
    parser.add_argument("--enable-torch-compile", action="store_true",
                        help="decode steps run the model's pointwise chains (norms, rotations, routing, activations) "
                             "through torch.compile, fused into a few kernels each: fewer kernels a decode graph, "
                             "compiled when first met (SGLang's flag of that name)")
    parser.add_argument("--index-key-cache-dtype", choices=INDEX_KEY_CACHE_DTYPES, default="auto",
                        help="the DSA indexer keys' cache: auto (the model's dtype) or fp8_e4m3 (a float32 scale a "
                             "row, as SGLang's DSA cache: half the bytes the decode indexer reads; top-k selections "
                             "may differ from the trainer's, which index replay covers)")
    parser.add_argument("--preload-weights", nargs="+", default=None, metavar="DIR",
                        help="checkpoint directories held in host memory (pinned on a GPU) from the start: "
                             "/update_weights_from_disk of one of them copies from there (teachers taking turns); "
                             "each may be loaded as if given to --weight-dir")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `serve`."""
    parser = subparsers.add_parser("serve", help="serve a model directory over SGLang's HTTP API (embedded engine)",
                                   description=__doc__)
    add_serve_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM."""
    from pathlib import Path  # noqa: PLC0415

    from slime_dsa.config.errors import UserError  # noqa: PLC0415

    if not (Path(args.model) / "config.json").exists():
        raise UserError(f"--model {args.model} has no config.json: not an HF-format model directory")
    _check_numbers(args, UserError)
    api_key = _api_key(args, UserError)
    from rollout.server.launch import serve  # noqa: PLC0415

    serve(args.model, args.host, args.port, api_key=api_key, weight_dirs=args.weight_dir,
          max_body_bytes=args.max_body_bytes,
          max_prompt_tokens=args.max_prompt_tokens, max_cache_tokens=args.max_cache_tokens,
          max_running_requests=args.max_running_requests, dtype=args.dtype, device=args.device,
          served_model_name=args.served_model_name, keep_indexer_topk=args.keep_indexer_topk,
          preload_weights=args.preload_weights, overlap=args.overlap,
          index_key_cache_dtype=args.index_key_cache_dtype,
          num_continuous_decode_steps=args.num_continuous_decode_steps,
          enable_torch_compile=args.enable_torch_compile)
    return 0


def _api_key(args: argparse.Namespace, error: type[Exception]) -> str | None:
    """--api-key, else $SLIME_DSA_API_KEY, else None (no key). An empty one is an error: the server would take it as
    no key and serve everyone (`--api-key "$KEY"` with KEY unset)."""
    from rollout.server.defaults import API_KEY_ENV  # noqa: PLC0415

    source, key = "--api-key", args.api_key
    if key is None:
        source, key = f"${API_KEY_ENV}", os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise error(f"{source} is empty: give the key clients must send, or unset it to serve without one")
    return key


DTYPE_NAMES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")  # checkpoint.hf_format._parse_dtype's


def _check_numbers(args: argparse.Namespace, error: type[Exception]) -> None:
    """One line for a flag out of range, before the model loads (else a ValueError traceback from the engine)."""
    from rollout.engine.defaults import DEFAULT_BLOCK_SIZE  # noqa: PLC0415

    if not 0 <= args.port <= 65535:
        raise error(f"--port must be in 0..65535, got {args.port}")
    for flag, value, least in (("--max-running-requests", args.max_running_requests, 1),
                               ("--max-cache-tokens", args.max_cache_tokens, DEFAULT_BLOCK_SIZE),
                               ("--max-body-bytes", args.max_body_bytes, 1),
                               ("--max-prompt-tokens", args.max_prompt_tokens, 1)):
        if value < least:
            raise error(f"{flag} must be >= {least}, got {value}")
    if args.dtype is not None and args.dtype not in DTYPE_NAMES:
        raise error(f"--dtype must be one of {', '.join(DTYPE_NAMES)}, got {args.dtype!r}")
    check_device(args.device, error)
    _check_preload(args.preload_weights or [], error)


def check_device(device: str | None, error: type[Exception]) -> None:
    """One line for --device other than cpu or cuda[:N], or a CUDA device torch does not see (else a torch
    RuntimeError traceback once the model loads)."""
    if device is None:
        return
    import torch  # noqa: PLC0415

    try:
        parsed = torch.device(device)
    except RuntimeError:
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise error(f"--device must be cpu or cuda (cuda:N), got {device!r}")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise error(f"--device {device}: torch sees no CUDA device on this machine; use --device cpu")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise error(f"--device {device}: torch sees {torch.cuda.device_count()} CUDA device(s)")


def _check_preload(directories: list[str], error: type[Exception]) -> None:
    """One line naming a --preload-weights directory that holds no loadable model, before the served one loads."""
    from pathlib import Path  # noqa: PLC0415

    from slime_dsa.checkpoint.validate import model_dir_problem  # noqa: PLC0415

    for directory in directories:
        if problem := model_dir_problem(Path(directory)):
            raise error(f"--preload-weights: {problem}")
