"""New weights to every engine after a training step: pause → update → resume, with a version.

Three transports, one protocol (SGLang's HTTP control API):
- http: the driver fetches the full state dict from trainer rank 0 and POSTs it in buckets to
  /update_weights_from_tensor (base64 safetensors). Works for engines anywhere.
- shm: trainer rank 0 writes one safetensors file into a directory under /dev/shm and every engine loads it
  through /update_weights_from_disk (a memory copy, mmap-read). The state dict never crosses Ray, JSON or a
  socket. Engines must run on rank 0's host.
- cuda_ipc: trainer rank 0 copies the weights, cast to the engine's dtypes, into one buffer on its GPU and every
  engine on that same GPU copies them out device to device, through a CUDA IPC handle sent as a JSON table to
  /update_weights_from_tensor (load_format cuda_ipc; slime_dsa.weights.cuda_ipc). Nothing touches host memory.
`choose_transport` picks cuda_ipc for embedded engines on trainer rank 0's GPU, else shm for embedded engines on
its node when /dev/shm has room, else http.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from rollout.client import EngineClient
from slime_dsa.weights.safetensors_b64 import tensor_update_payloads

logger = logging.getLogger(__name__)

SHM_ROOT = Path("/dev/shm")
SHM_WEIGHTS_FILE = "model.safetensors"
Transport = Literal["http", "shm", "cuda_ipc"]
TRANSPORTS = ("http", "shm", "cuda_ipc")


async def push_weights(client: EngineClient, state_dict: dict[str, torch.Tensor], version: int,
                       bucket_bytes: int = 256 * 1024**2, pause_mode: str = "abort") -> float:
    """Send the full state dict to all engines through /update_weights_from_tensor; returns seconds taken.

    Engines are paused so no token is sampled from half-updated weights; the last bucket flushes the prefix
    cache and sets the new weight_version. pause_mode says what happens to requests in flight: abort (they end;
    the synchronous loop has none), retract or in_place (they continue under the new weights after resume: the
    partial rollouts of the asynchronous loop; each token records the version that produced it).
    """
    start = time.perf_counter()
    await client.broadcast("/pause_generation", {"mode": pause_mode})
    try:
        for payload in tensor_update_payloads(state_dict, weight_version=str(version), bucket_bytes=bucket_bytes):
            await client.broadcast("/update_weights_from_tensor", payload)
    finally:
        await client.broadcast("/continue_generation", {})
    elapsed = time.perf_counter() - start
    logger.info("weights v%d pushed to %d engines in %.2fs", version, len(client.engines), elapsed)
    return elapsed


async def load_weights_from_disk(client: EngineClient, model_path: str | Path, version: int,
                                 pause_mode: str = "abort") -> float:
    """Have every engine load `model_path` (a directory with model.safetensors) as `version`; returns seconds."""
    from slime_dsa.weights.payloads import update_weights_from_disk_payload  # noqa: PLC0415

    start = time.perf_counter()
    await client.broadcast("/pause_generation", {"mode": pause_mode})
    try:
        results = await client.broadcast("/update_weights_from_disk",
                                         update_weights_from_disk_payload(str(model_path), weight_version=str(version)))
    finally:
        await client.broadcast("/continue_generation", {})
    refused = {url: body for url, body in results.items() if isinstance(body, dict) and body.get("success") is False}
    if refused:
        raise RuntimeError(f"engines could not load weights from {model_path}: {refused}")
    elapsed = time.perf_counter() - start
    logger.info("weights v%d loaded by %d engines from %s in %.3fs", version, len(client.engines), model_path, elapsed)
    return elapsed


async def update_weights_from_cuda_ipc(client: EngineClient, table: dict, version: int,
                                      pause_mode: str = "abort") -> float:
    """Have every engine copy the weights out of trainer rank 0's shared GPU buffer (`table`: its cuda_ipc JSON) as
    `version`; returns seconds."""
    from slime_dsa.weights.cuda_ipc import LOAD_FORMAT_CUDA_IPC  # noqa: PLC0415

    start = time.perf_counter()
    payload = {"serialized_named_tensors": [table], "load_format": LOAD_FORMAT_CUDA_IPC, "flush_cache": True,
               "weight_version": str(version)}
    await client.broadcast("/pause_generation", {"mode": pause_mode})
    try:
        await client.broadcast("/update_weights_from_tensor", payload)  # a refusal raises EngineError naming the engine
    finally:
        await client.broadcast("/continue_generation", {})
    elapsed = time.perf_counter() - start
    logger.info("weights v%d copied by %d engines from the trainer's GPU in %.3fs", version, len(client.engines), elapsed)
    return elapsed


@dataclass
class WeightSync:
    """The run's weight transport: `push` sends the trainers' current weights to every engine."""

    client: EngineClient
    trainers: Any  # trainers.fsdp.group.TrainerGroup
    transport: Transport = "http"
    directory: Path | None = None  # shm: where rank 0 writes SHM_WEIGHTS_FILE
    engine_dtype: str | None = None  # cuda_ipc: the engines' dtype, which rank 0 casts to
    _cleanup: weakref.finalize | None = field(default=None, repr=False)

    @classmethod
    def create(cls, client: EngineClient, trainers: Any, transport: Transport, model_dir: Path,
               engine_dtype: str | None = None) -> "WeightSync":
        """A WeightSync; shm makes a private directory under /dev/shm with the model's config.json; cuda_ipc needs
        the engines' `engine_dtype`."""
        if transport == "http":
            return cls(client, trainers)
        if transport == "cuda_ipc":
            if engine_dtype is None:
                raise ValueError("weight sync cuda_ipc needs the engines' dtype")
            return cls(client, trainers, "cuda_ipc", engine_dtype=engine_dtype)
        directory = Path(tempfile.mkdtemp(prefix="slime-dsa-weights-", dir=SHM_ROOT))
        if (model_dir / "config.json").exists():
            shutil.copy2(model_dir / "config.json", directory / "config.json")  # a loadable HF directory
        sync = cls(client, trainers, "shm", directory)
        # /dev/shm is memory: free it even when the run dies before close() (at exit at the latest).
        sync._cleanup = weakref.finalize(sync, shutil.rmtree, directory, True)
        return sync

    async def push(self, version: int, pause_mode: str = "abort", want_state: bool = False) -> dict | None:
        """Send the weights as `version`; returns the full state dict when `want_state` (else None)."""
        if self.transport == "http":
            state = await asyncio.to_thread(self.trainers.full_state_dict)
            await push_weights(self.client, state, version, pause_mode=pause_mode)
            return state if want_state else None
        if self.transport == "cuda_ipc":
            table = await asyncio.to_thread(self.trainers.share_weights, self.engine_dtype)
            await update_weights_from_cuda_ipc(self.client, table, version, pause_mode=pause_mode)
            return await asyncio.to_thread(self.trainers.full_state_dict) if want_state else None
        path = self.directory / SHM_WEIGHTS_FILE
        await asyncio.to_thread(self.trainers.save_weights, str(path))
        await load_weights_from_disk(self.client, self.directory, version, pause_mode=pause_mode)
        if not want_state:
            return None
        from safetensors.torch import load  # noqa: PLC0415

        return load(path.read_bytes())  # its own memory: the file is rewritten by the next version

    def close(self) -> None:
        """Remove the shm directory (idempotent)."""
        if self._cleanup is not None:
            self._cleanup()


def choose_transport(setting: str, engine_kind: str, engine_nodes: list[str | None], trainer_node: str | None,
                     model_bytes: int, shm_root: Path = SHM_ROOT, engine_devices: list[str | None] | None = None,
                     trainer_device: str | None = None) -> Transport:
    """The transport for rollout.weight_sync `setting`: http | shm | cuda_ipc as given (cuda_ipc checked); auto =
    cuda_ipc when every engine is an embedded engine on trainer rank 0's node and GPU (`engine_devices` and
    `trainer_device`: CUDA device UUIDs, None off CUDA), else shm when they are on its node and shm_root has room
    for two copies of the weights, else http."""
    if setting not in ("auto", *TRANSPORTS):
        raise ValueError(f"rollout.weight_sync must be auto, {', '.join(TRANSPORTS)}, got {setting!r}")
    same_node = engine_kind == "embedded" and bool(engine_nodes) and trainer_node is not None \
        and all(node == trainer_node for node in engine_nodes)
    if setting == "cuda_ipc":
        if problem := _cuda_ipc_problem(engine_kind, same_node, engine_devices, trainer_device):
            raise ValueError(f"rollout.weight_sync 'cuda_ipc' {problem}")
        return "cuda_ipc"
    if setting in ("http", "shm"):
        if setting == "shm" and not _writable_dir(shm_root):
            raise ValueError(f"rollout.weight_sync 'shm' needs a writable {shm_root}")
        return setting  # type: ignore[return-value]
    if not same_node:
        return "http"
    if _cuda_ipc_problem(engine_kind, same_node, engine_devices, trainer_device) is None:
        return "cuda_ipc"
    if not _writable_dir(shm_root):
        return "http"
    free = shutil.disk_usage(shm_root).free
    if free < 2 * model_bytes:  # the current file plus the next one being written
        logger.info("weight sync over http: %s has %.0f MiB free, the weights need 2 x %.0f MiB",
                    shm_root, free / 2**20, model_bytes / 2**20)
        return "http"
    return "shm"


def _cuda_ipc_problem(engine_kind: str, same_node: bool, engine_devices: list[str | None] | None,
                      trainer_device: str | None) -> str | None:
    """Why cuda_ipc cannot serve these engines (one line), or None when it can."""
    if engine_kind != "embedded":
        return f"needs embedded engines, got rollout.engine {engine_kind!r}"
    if not same_node:
        return "needs every engine on trainer rank 0's Ray node"
    if trainer_device is None:
        return "needs trainer rank 0 on a CUDA device"
    if not engine_devices:
        return "needs the engines' CUDA devices"
    for i, device in enumerate(engine_devices):
        if device != trainer_device:
            where = "not on a CUDA device" if device is None else f"on GPU {device}"
            return f"needs every engine on trainer rank 0's GPU ({trainer_device}); engine {i} is {where}"
    return None


def _writable_dir(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def full_state_bytes(model_dir: Path) -> int:
    """Bytes of the float32 state dict of the model in `model_dir`, from its safetensors headers."""
    from safetensors import safe_open  # noqa: PLC0415

    total = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                total += 4 * _numel(f.get_slice(key).get_shape())
    return total


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
