"""Ray actors that each own one engine: the embedded engine behind our HTTP server, or a real SGLang server.

An actor starts its engine on a free port and returns the URL; everything else talks to it over HTTP through
rollout.client.EngineClient, exactly as to external engines. One actor per GPU (num_gpus=1; Ray sets
CUDA_VISIBLE_DEVICES, which an SGLang subprocess inherits), or as many as asked on CPU (num_cpus each).
Ray is imported only in this module.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import asdict
from typing import Any

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


NODE_ADDRESS = "node"  # an EngineActor host: its Ray node's address, where the run's other nodes reach it


class EngineActor:
    """One engine and its HTTP endpoint. kind "embedded" needs model_dir; kind "sglang" needs sglang_config.

    host: the address to listen on; NODE_ADDRESS for this actor's node address (a run across nodes). log_file: this
    process's log records of INFO and above (the engine's, the server's) are appended there; without it a Ray worker
    keeps Python's default, WARNING and above on stderr (Ray's worker log)."""

    def __init__(self, kind: str = "embedded", *, model_dir: str | None = None, sglang_config: Any = None,
                 host: str = "127.0.0.1", port: int = 0, engine_kwargs: dict | None = None,
                 server_kwargs: dict | None = None, launcher_kwargs: dict | None = None,
                 log_file: str | None = None) -> None:
        if log_file:
            log_to(log_file)
        if kind not in ("embedded", "sglang"):
            raise ValueError(f"kind must be 'embedded' or 'sglang', got {kind!r}")
        if kind == "embedded" and not model_dir:
            raise ValueError("kind 'embedded' needs model_dir")
        if kind == "sglang" and sglang_config is None:
            raise ValueError("kind 'sglang' needs sglang_config")
        self.kind, self.model_dir, self.sglang_config = kind, model_dir, sglang_config
        self.host, self.port = host, port
        self.engine_kwargs, self.server_kwargs = engine_kwargs or {}, server_kwargs or {}
        self.launcher_kwargs = launcher_kwargs or {}
        self._server: Any = None  # EmbeddedServer or SGLangServer
        self._engine: Any = None  # the embedded AsyncEngine
        self._url: str | None = None
        self._stopped: asyncio.Event | None = None  # set by stop(); wait_stopped returns then

    def _bind_host(self) -> str:
        return _node_address() if self.host == NODE_ADDRESS else self.host

    def _public_host(self) -> str:
        """The address callers use: the node's when listening on all of its interfaces or on its address."""
        return _node_address() if self.host in (NODE_ADDRESS, "0.0.0.0", "::") else self.host

    async def start(self) -> str:
        """Start the engine and its server; returns the URL (idempotent)."""
        if self._url is not None:
            return self._url
        if self.kind == "embedded":
            from rollout.server.launch import EmbeddedServer, load_engine  # noqa: PLC0415

            engine, tokenizer = await asyncio.to_thread(load_engine, self.model_dir, **self.engine_kwargs)
            self._engine = engine
            self._server = await EmbeddedServer.start(engine, tokenizer, host=self._bind_host(), port=self.port,
                                                      model_path=self.model_dir, **self.server_kwargs)
            port = self._server.port
            from slime_dsa.gc_watch import freeze_after_startup  # noqa: PLC0415

            freeze_after_startup("engine")  # the actor's process holds this one engine for the run
        else:
            from rollout.sglang.config import SGLangConfig, SpeculativeConfig  # noqa: PLC0415
            from rollout.sglang.launcher import SGLangServer  # noqa: PLC0415

            cfg = self.sglang_config
            if isinstance(cfg, dict):
                cfg = dict(cfg)
                if isinstance(cfg.get("speculative"), dict):
                    cfg["speculative"] = SpeculativeConfig(**cfg["speculative"])
                cfg = SGLangConfig(**cfg)
            cfg.port = self.port or free_port()
            cfg.host = self._bind_host()
            self._server = SGLangServer(cfg, **self.launcher_kwargs)
            await asyncio.to_thread(self._server.start)
            port = cfg.port
        self._url = f"http://{self._public_host()}:{port}"
        logger.info("engine actor (%s) serving at %s", self.kind, self._url)
        return self._url

    async def url(self) -> str | None:
        return self._url

    async def pid(self) -> int:
        """This actor's process id (the embedded engine runs in it)."""
        import os  # noqa: PLC0415

        return os.getpid()

    async def wait_stopped(self) -> None:
        """Returns when stop() is called. The orchestrator keeps one call pending per engine: if the process dies
        instead, Ray fails that call at once (RayActorError), which is how a lost engine is noticed."""
        if self._stopped is None:
            self._stopped = asyncio.Event()
        await self._stopped.wait()

    async def node_id(self) -> str:
        """The Ray node this engine runs on (engines on a trainer's node can load weights from its /dev/shm)."""
        import ray  # noqa: PLC0415

        return ray.get_runtime_context().get_node_id()

    async def cuda_device(self) -> dict | None:
        """{"uuid", "dtype"} of an embedded engine on a CUDA device, else None: cuda_ipc weight sync needs trainer
        rank 0 on the GPU with that UUID (indices differ between actors: Ray sets CUDA_VISIBLE_DEVICES per actor)."""
        if self._engine is None or self._engine.engine.device.type != "cuda":
            return None
        from slime_dsa.weights.cuda_ipc import device_uuid, dtype_name  # noqa: PLC0415

        engine = self._engine.engine
        return {"uuid": device_uuid(engine.device), "dtype": dtype_name(engine.model.dtype)}

    async def stop(self) -> None:
        """Stop the server and the engine."""
        if self._stopped is not None:
            self._stopped.set()
        if self._server is None:
            return
        if self.kind == "embedded":
            await self._server.stop()
        else:
            await asyncio.to_thread(self._server.stop)
        self._server, self._url, self._engine = None, None, None


def _node_address() -> str:
    import ray  # noqa: PLC0415

    return ray.util.get_node_ip_address()


def log_to(path: str) -> None:
    """Root-logger records of INFO and above also to `path` (appended: a resumed run's engine continues the file);
    WARNING and above still reach stderr, where Python's default handler wrote them before."""
    from pathlib import Path  # noqa: PLC0415

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    before = root.getEffectiveLevel()
    # What stderr got stays as it was (Ray forwards a worker's stderr to the driver's console): the handlers already
    # there keep the old level, and Python's default one, which stops once the root has a handler, is replaced.
    for existing in root.handlers:
        existing.setLevel(max(existing.level, before))
    if not root.handlers:
        stderr = logging.StreamHandler()
        stderr.setLevel(before)
        root.addHandler(stderr)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(min(before, logging.INFO))


def create_engine_actors(
    num_engines: int,
    *,
    kind: str = "embedded",
    num_gpus_per_engine: float = 0,
    num_cpus_per_engine: float = 1,
    log_files: list[str] | None = None,
    **actor_kwargs: Any,
) -> list[Any]:
    """`num_engines` EngineActor handles (not started): one per GPU when num_gpus_per_engine=1, else on CPUs.
    log_files: one per engine, its log (EngineActor's log_file)."""
    import ray  # noqa: PLC0415

    if num_engines < 1:
        raise ValueError(f"num_engines must be >= 1, got {num_engines}")
    if log_files is not None and len(log_files) != num_engines:
        raise ValueError(f"need one log file per engine, got {len(log_files)} for {num_engines}")
    logs = log_files or [None] * num_engines
    if kind == "sglang" and hasattr(actor_kwargs.get("sglang_config"), "__dataclass_fields__"):
        actor_kwargs["sglang_config"] = asdict(actor_kwargs["sglang_config"])  # plain data across the Ray boundary
    cls = ray.remote(EngineActor)
    return [
        cls.options(num_cpus=num_cpus_per_engine, num_gpus=num_gpus_per_engine, max_concurrency=1000)
        .remote(kind, log_file=log, **actor_kwargs)
        for log in logs
    ]


def start_engine_actors(actors: list[Any], timeout_s: float | None = None) -> list[str]:
    """Start every actor's engine in parallel; returns their URLs in order."""
    import ray  # noqa: PLC0415

    return ray.get([a.start.remote() for a in actors], timeout=timeout_s)
