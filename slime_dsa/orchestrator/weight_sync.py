"""New weights to every engine after a training step: pause → update → resume, with a version.

Two transports, one protocol (SGLang's HTTP control API):
- http: the driver fetches the full state dict from trainer rank 0 and POSTs it in buckets to
  /update_weights_from_tensor (base64 safetensors). Works for engines anywhere.
- shm: trainer rank 0 writes one safetensors file into a directory under /dev/shm and every engine loads it
  through /update_weights_from_disk (a memory copy, mmap-read). The state dict never crosses Ray, JSON or a
  socket. Engines must run on rank 0's host.
`choose_transport` picks shm for embedded engines on the trainer's node when /dev/shm has room, else http.
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
from rollout.server.weights import tensor_update_payloads

logger = logging.getLogger(__name__)

SHM_ROOT = Path("/dev/shm")
SHM_WEIGHTS_FILE = "model.safetensors"
Transport = Literal["http", "shm"]


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
    from rollout.sglang.weight_sync import update_weights_from_disk_payload  # noqa: PLC0415

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


@dataclass
class WeightSync:
    """The run's weight transport: `push` sends the trainers' current weights to every engine."""

    client: EngineClient
    trainers: Any  # trainers.fsdp.group.TrainerGroup
    transport: Transport = "http"
    directory: Path | None = None  # shm: where rank 0 writes SHM_WEIGHTS_FILE
    _cleanup: weakref.finalize | None = field(default=None, repr=False)

    @classmethod
    def create(cls, client: EngineClient, trainers: Any, transport: Transport, model_dir: Path) -> "WeightSync":
        """A WeightSync; shm makes a private directory under /dev/shm with the model's config.json."""
        if transport == "http":
            return cls(client, trainers)
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
                     model_bytes: int, shm_root: Path = SHM_ROOT) -> Transport:
    """The transport for rollout.weight_sync `setting`: http | shm as given; auto = shm when every engine is an
    embedded engine on the trainer rank 0's node and shm_root has room for two copies of the weights."""
    if setting in ("http", "shm"):
        if setting == "shm" and not _writable_dir(shm_root):
            raise ValueError(f"rollout.weight_sync 'shm' needs a writable {shm_root}")
        return setting  # type: ignore[return-value]
    if setting != "auto":
        raise ValueError(f"rollout.weight_sync must be auto, http or shm, got {setting!r}")
    if engine_kind != "embedded" or not engine_nodes or trainer_node is None:
        return "http"
    if any(node != trainer_node for node in engine_nodes):
        return "http"
    if not _writable_dir(shm_root):
        return "http"
    free = shutil.disk_usage(shm_root).free
    if free < 2 * model_bytes:  # the current file plus the next one being written
        logger.info("weight sync over http: %s has %.0f MiB free, the weights need 2 x %.0f MiB",
                    shm_root, free / 2**20, model_bytes / 2**20)
        return "http"
    return "shm"


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
