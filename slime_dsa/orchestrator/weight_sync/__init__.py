"""New weights to every engine after a training step: one interface, one file per transport, and one
pause → update → continue routine (base.paused_update) that every transport runs. Embedded engines take a
one-request update (shm, cuda_ipc) with the pause in it: they pause, update and continue in one command.

  base.py         WeightTransport (push, close) and paused_update
  http.py         http: the state dict in /update_weights_from_tensor requests (base64 safetensors)
  disk.py         shm and disk: rank 0 writes a safetensors directory that engines load (/update_weights_from_disk)
  cuda_ipc.py     cuda_ipc: rank 0's GPU buffer, read by embedded engines on its GPU through a CUDA IPC handle
  distributed.py  distributed: SGLang's NCCL group, rank 0 broadcasts while engines receive

rollout.weight_sync picks among http, shm and cuda_ipc for embedded and external engines; rollout.sglang.weight_sync
between disk and distributed for SGLang servers. `build_weight_sync` resolves either from where things run.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Literal

from slime_dsa.config.errors import UserError
from slime_dsa.orchestrator.weight_sync.base import WeightTransport, paused_update
from slime_dsa.orchestrator.weight_sync.cuda_ipc import CudaIpcTransport
from slime_dsa.orchestrator.weight_sync.disk import SHM_ROOT, DiskTransport, remove_stale_shm_dirs, shm_dir_name
from slime_dsa.orchestrator.weight_sync.distributed import DistributedTransport
from slime_dsa.orchestrator.weight_sync.http import HttpTransport

logger = logging.getLogger(__name__)

Transport = Literal["http", "shm", "cuda_ipc", "disk", "distributed"]
TRANSPORTS = ("http", "shm", "cuda_ipc")  # rollout.weight_sync's choices besides auto
ENGINE_WEIGHTS_DIR = "engine_weights"  # rollout.sglang.weight_sync disk: under the run directory

__all__ = ["WeightTransport", "paused_update", "HttpTransport", "DiskTransport", "CudaIpcTransport",
           "DistributedTransport", "choose_transport", "choose_sglang_transport", "build_weight_sync",
           "full_state_bytes", "SHM_ROOT", "TRANSPORTS", "Transport", "remove_stale_shm_dirs", "shm_dir_name",
           "engine_weight_dirs", "ENGINE_WEIGHTS_DIR"]


def engine_weight_dirs(run_dir: Path, shm_dir: Path) -> list[str]:
    """The directories engines the run starts may load weights from (/update_weights_from_disk): the shm directory
    and the run's engine_weights directory, whichever transport is chosen later."""
    return [str(shm_dir), str(Path(run_dir).resolve() / ENGINE_WEIGHTS_DIR)]


def choose_transport(setting: str, engine_kind: str, engine_nodes: list[str | None], trainer_node: str | None,
                     model_bytes: int, shm_root: Path = SHM_ROOT, engine_devices: list[str | None] | None = None,
                     trainer_device: str | None = None, driver_node: str | None = None) -> Transport:
    """The transport for rollout.weight_sync `setting` (embedded or external engines): http | shm | cuda_ipc as given
    (cuda_ipc checked); auto = cuda_ipc when every engine is an embedded engine on trainer rank 0's node and GPU
    (`engine_devices` and `trainer_device`: CUDA device UUIDs, None off CUDA), else shm when they are on its node,
    which is `driver_node` too (None: not known), and shm_root has room for two copies of the weights, else http."""
    if engine_kind == "sglang":
        raise ValueError("rollout.engine 'sglang' takes its weight transport from rollout.sglang.weight_sync")
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
        if setting == "shm" and engine_kind == "embedded" and trainer_node is not None and not same_node:
            raise UserError(f"rollout.weight_sync 'shm' needs every engine on trainer rank 0's Ray node (they load "
                            f"from its {shm_root}), and the Ray cluster placed some on other nodes: use auto or http")
        if setting == "shm" and not _drivers_node(trainer_node, driver_node):
            raise UserError(f"rollout.weight_sync 'shm' needs trainer rank 0 on this driver's Ray node (the driver "
                            f"makes its {shm_root} directory and reads the weights back there), and the Ray cluster "
                            "placed it on another: use auto or http")
        return setting  # type: ignore[return-value]
    if not same_node:
        return "http"
    if _cuda_ipc_problem(engine_kind, same_node, engine_devices, trainer_device) is None:
        return "cuda_ipc"
    if not _writable_dir(shm_root) or not _drivers_node(trainer_node, driver_node):
        return "http"
    free = shutil.disk_usage(shm_root).free
    if free < 2 * model_bytes:  # the current file plus the next one being written
        logger.info("weight sync over http: %s has %.0f MiB free, the weights need 2 x %.0f MiB",
                    shm_root, free / 2**20, model_bytes / 2**20)
        return "http"
    return "shm"


def choose_sglang_transport(setting: str, placement: str) -> Transport:
    """The transport for rollout.sglang.weight_sync `setting`: disk | distributed as given; auto = distributed when
    cluster.placement is disaggregated, else disk (NCCL cannot put trainer rank 0 and an engine rank on one GPU)."""
    if setting == "auto":
        return "distributed" if placement == "disaggregated" else "disk"
    if setting not in ("disk", "distributed"):
        raise ValueError(f"rollout.sglang.weight_sync {setting!r} is not available; use auto, distributed or disk")
    return setting  # type: ignore[return-value]


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


def _drivers_node(trainer_node: str | None, driver_node: str | None) -> bool:
    """Whether trainer rank 0 is on the driver's node, as far as known: the shm directory is the driver's."""
    return trainer_node is None or driver_node is None or trainer_node == driver_node


def _writable_dir(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def full_state_bytes(model_dir: Path) -> int:
    """Bytes of the float32 state dict of the model in `model_dir`, from its safetensors headers."""
    from safetensors import safe_open  # noqa: PLC0415

    total = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                n = 4
                for d in f.get_slice(key).get_shape():
                    n *= d
                total += n
    return total


def build_weight_sync(recipe: Any, client: Any, trainers: Any, engine_actors: list[Any], model_dir: Path,
                      run_dir: Path, shm_dir: Path | None = None) -> WeightTransport:
    """The run's transport: rollout.sglang.weight_sync for SGLang servers, else rollout.weight_sync; auto is
    resolved from where the engines and trainer rank 0 run. shm_dir: the shm directory the engines were told of."""
    ro = recipe.rollout
    if ro.engine == "sglang":
        name = choose_sglang_transport(ro.sglang.weight_sync, recipe.cluster.placement)
        setting = f"rollout.sglang.weight_sync {ro.sglang.weight_sync}"
        # SGLang runs on GPUs, where model.dtype auto means bfloat16; the engines cast whatever arrives anyway.
        engine_dtype = "bfloat16" if recipe.model.dtype == "auto" else recipe.model.dtype
    else:
        name, engine_dtype = _embedded_or_external(recipe, trainers, engine_actors, model_dir)
        setting = f"rollout.weight_sync {ro.weight_sync}"
    if name == "http":
        transport: WeightTransport = HttpTransport(client, trainers)
    elif name == "cuda_ipc":
        transport = CudaIpcTransport(client, trainers, engine_dtype)
    elif name == "shm":
        transport = DiskTransport.in_shm(client, trainers, model_dir, directory=shm_dir)
    elif name == "disk":
        transport = DiskTransport.in_directory(client, trainers, model_dir, Path(run_dir) / ENGINE_WEIGHTS_DIR)
    else:
        transport = DistributedTransport(client, trainers, ranks_per_engine=ro.sglang.tp, engine_dtype=engine_dtype)
    # This repo's embedded engines take the pause in the update request itself: one request per engine a step.
    transport.engines_pause = ro.engine == "embedded"
    where = getattr(transport, "directory", None)
    logger.info("weight sync: %s%s (%s)", name, f" through {where}" if where else "", setting)
    return transport


def _embedded_or_external(recipe: Any, trainers: Any, engine_actors: list[Any],
                          model_dir: Path) -> tuple[Transport, str | None]:
    """(rollout.weight_sync resolved, the engines' dtype for cuda_ipc)."""
    import ray  # noqa: PLC0415

    ro = recipe.rollout
    embedded = ro.engine == "embedded"
    nodes = ray.get([a.node_id.remote() for a in engine_actors]) if embedded else []
    trainer_node = trainers.node_id() if ro.weight_sync in ("auto", "cuda_ipc", "shm") else None
    # GPUs by UUID, not index: each Ray actor sees its own CUDA_VISIBLE_DEVICES numbering.
    wants_gpu = embedded and ro.weight_sync in ("auto", "cuda_ipc")
    engine_gpus = ray.get([a.cuda_device.remote() for a in engine_actors]) if wants_gpu else []
    trainer_gpu = trainers.cuda_device() if wants_gpu else None
    name = choose_transport(ro.weight_sync, ro.engine, nodes, trainer_node, full_state_bytes(model_dir),
                            engine_devices=[g and g["uuid"] for g in engine_gpus], trainer_device=trainer_gpu,
                            driver_node=ray.get_runtime_context().get_node_id())
    return name, engine_gpus[0]["dtype"] if name == "cuda_ipc" else None
