"""Start the embedded server: load a model directory into an AsyncEngine and serve it over HTTP."""

from __future__ import annotations

import errno
import logging
import socket
from pathlib import Path
from typing import Any, Sequence

from aiohttp import web

from rollout.engine.defaults import DEFAULT_MAX_CACHE_TOKENS, DEFAULT_MAX_RUNNING_REQUESTS
from rollout.server.app import create_app
from rollout.server.defaults import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_PORT
from slime_dsa.gc_watch import freeze_after_startup

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(source: str | Path) -> Any:
    """The tokenizer at `source`: a directory (None when it holds none, as a model saved without one) or a hub id."""
    if Path(source).is_dir() and not any((Path(source) / name).exists() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(source))


def load_engine(
    model_dir: str | Path,
    *,
    max_cache_tokens: int = DEFAULT_MAX_CACHE_TOKENS,
    max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS,
    dtype: str | None = None,
    device: str | None = None,
    weight_version: str = "0",
    ops_backend: str = "auto",
    keep_indexer_topk: bool = False,
    preload_weights: list[str] | None = None,
    overlap: bool = False,
    true_on_policy: bool = False,
    warmup_max_len: int = 0,
    index_key_cache_dtype: str = "auto",
    tokenizer_path: str | None = None,
    num_continuous_decode_steps: int = 1,
    enable_torch_compile: bool = False,
) -> tuple[Any, Any]:
    """(AsyncEngine, tokenizer) for an HF-format model directory; the engine is not started yet.

    `ops_backend` (auto | torch | triton) picks the DSA kernels for this process, as the recipe's model.ops_backend.
    `keep_indexer_topk` keeps every cached row's DSA top-k, so requests can get their prompt rows' (index replay).
    `preload_weights`: checkpoint directories read into (pinned) host memory now, which /update_weights_from_disk
    then copies from (teachers taking turns on one engine). `overlap`: the engine's overlap scheduler (Engine).
    `true_on_policy`: batch-invariant ops for this process (slime_dsa.ops.invariant), as the recipe's model key.
    `warmup_max_len` (CUDA only; 0: none): compile the kernels and capture the decode graphs for samples of up to
    that many tokens now, not in the first rollout (rollout/engine/warmup.py). `index_key_cache_dtype`: auto |
    fp8_e4m3, the DSA indexer keys' cache (Engine). `tokenizer_path`: the tokenizer for stop strings and text
    (the run's model.tokenizer_path); None: the one saved with the model. The engine stops on the ids SGLang
    stops on (rollout.engine.stop.engine_eos_token_ids): config.json's and generation_config.json's eos_token_id and
    the tokenizer's eos_token. `num_continuous_decode_steps`: decode steps a launch when every running request
    decodes (Engine). `enable_torch_compile`: the model's pointwise chains compiled into fused kernels (Engine).
    """
    import torch

    from slime_dsa import ops

    ops.set_backend(ops_backend)
    ops.invariant.set_enabled(true_on_policy)
    from rollout.engine.async_engine import AsyncEngine
    from rollout.engine.engine import Engine
    from rollout.engine.stop import engine_eos_token_ids
    from slime_dsa.checkpoint import load_model
    from slime_dsa.models.config import generation_eos_token_ids

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    # An engine never trains: without grad on its weights no forward of it, in a step or not, keeps an autograd graph
    model = load_model(model_dir, dtype=dtype, device=device).eval().requires_grad_(False)
    tokenizer = load_tokenizer(tokenizer_path or model_dir)
    eos_ids = engine_eos_token_ids(model.config.eos_token_ids, generation_eos_token_ids(model_dir), tokenizer)
    engine = Engine(model, max_cache_tokens=max_cache_tokens, max_running_requests=max_running_requests,
                    eos_token_ids=eos_ids, tokenizer=tokenizer, weight_version=weight_version,
                    keep_indexer_topk=keep_indexer_topk, overlap=overlap, index_key_cache_dtype=index_key_cache_dtype,
                    num_continuous_decode_steps=num_continuous_decode_steps,
                    enable_torch_compile=enable_torch_compile)
    if warmup_max_len > 0 and engine.device.type == "cuda":
        from rollout.engine.warmup import warm_up_or_recover

        seconds = warm_up_or_recover(engine, warmup_max_len)
        if seconds is not None:
            logger.info("engine: kernels compiled and decode graphs captured for samples up to %d tokens in %.1f s",
                        warmup_max_len, seconds)
    async_engine = AsyncEngine(engine, model_path=str(model_dir),
                               tokenizer_path=str(tokenizer_path or model_dir) if tokenizer else None)
    async_engine.preload_weights(preload_weights or [])
    return async_engine, tokenizer


class EmbeddedServer:
    """The HTTP app of one AsyncEngine, listening inside the running event loop (tests, Ray actors)."""

    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        self.runner, self.host, self.port = runner, host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @classmethod
    async def start(cls, async_engine: Any, tokenizer: Any = None, *, host: str = "127.0.0.1", port: int = 0,
                    **app_kwargs: Any) -> "EmbeddedServer":
        """Start the engine and the server; port 0 picks a free port (read it from .port / .url)."""
        app = create_app(async_engine, tokenizer, host=host, **app_kwargs)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
        await runner.setup()
        site = web.TCPSite(runner, host, port, backlog=2048)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        bound = runner.addresses[0][1]
        logger.info("embedded server listening on http://%s:%d", host, bound)
        return cls(runner, host, bound)

    async def stop(self) -> None:
        """Stop accepting requests, cancel the running ones (their engine requests abort), stop the engine."""
        await self.runner.cleanup()


def check_port(host: str, port: int) -> None:
    """UserError (one line) when `port` on `host` cannot be bound: checked before the model loads."""
    from slime_dsa.config.errors import UserError  # noqa: PLC0415

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds: a TIME_WAIT port is free
        try:
            sock.bind((host, port))
        except OSError as e:
            if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:  # the host is the problem
                raise UserError(f"--host {host} cannot be bound ({e.strerror}); give an address of this machine, or "
                                "0.0.0.0 for all of them") from None
            why = "is in use (another server?)" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            raise UserError(f"port {port} on {host} {why}; choose another with --port") from None


def load_checked_engine(model_dir: str | Path, **engine_kwargs: Any) -> tuple[Any, Any]:
    """load_engine, with a bad model directory as one UserError naming the file or tensor: unreadable config or
    safetensors files, tensors missing or misshapen, NaN or infinite weights."""
    import torch  # noqa: PLC0415

    from slime_dsa.checkpoint.hf_format import CheckpointError  # noqa: PLC0415
    from slime_dsa.checkpoint.validate import model_dir_problem  # noqa: PLC0415
    from slime_dsa.config.errors import UserError  # noqa: PLC0415

    if problem := model_dir_problem(Path(model_dir)):
        raise UserError(problem)
    try:
        engine, tokenizer = load_engine(model_dir, **engine_kwargs)
    except CheckpointError as e:
        raise UserError(f"{model_dir}: {e}") from None
    for name, tensor in engine.engine.model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise UserError(f"{model_dir}: tensor {name} holds NaN or infinite values; refusing to serve it")
    return engine, tokenizer


def serve(
    model_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    *,
    api_key: str | None = None,
    weight_dirs: Sequence[str] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_prompt_tokens: int | None = DEFAULT_MAX_PROMPT_TOKENS,
    max_cache_tokens: int = DEFAULT_MAX_CACHE_TOKENS,
    max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS,
    dtype: str | None = None,
    device: str | None = None,
    served_model_name: str | None = None,
    keep_indexer_topk: bool = False,
    preload_weights: list[str] | None = None,
    overlap: bool = False,
    index_key_cache_dtype: str = "auto",
    num_continuous_decode_steps: int = 1,
    enable_torch_compile: bool = False,
) -> None:
    """Load `model_dir` and serve it until SIGINT/SIGTERM. Binds 127.0.0.1 unless `host` says otherwise.

    A busy port and a bad model directory fail first, as one UserError."""
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        logger.warning("serving on %s without an API key: anyone who reaches this port can generate and "
                       "replace the weights", host)
    check_port(host, port)
    engine, tokenizer = load_checked_engine(model_dir, max_cache_tokens=max_cache_tokens,
                                            max_running_requests=max_running_requests, dtype=dtype, device=device,
                                            keep_indexer_topk=keep_indexer_topk, preload_weights=preload_weights,
                                            overlap=overlap, index_key_cache_dtype=index_key_cache_dtype,
                                            num_continuous_decode_steps=num_continuous_decode_steps,
                                            enable_torch_compile=enable_torch_compile)
    app = create_app(engine, tokenizer, api_key=api_key, max_body_bytes=max_body_bytes,
                     max_prompt_tokens=max_prompt_tokens, model_path=str(model_dir),
                     served_model_name=served_model_name,
                     weight_dirs=[*weight_dirs, *(preload_weights or [])],  # a preloaded directory may be loaded
                     host=host)
    freeze_after_startup("engine")  # this process serves one engine: its start-up objects live as long
    web.run_app(app, host=host, port=port, handler_cancellation=True, backlog=2048, access_log=None,
                shutdown_timeout=5.0, print=lambda msg: logger.info(msg.strip()))
