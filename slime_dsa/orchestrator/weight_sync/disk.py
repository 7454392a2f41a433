"""Weights through a directory: trainer rank 0 writes one model.safetensors (write, then rename) next to the model's
config.json, and every engine loads the directory through /update_weights_from_disk, which both our embedded
server and SGLang serve. The state dict never crosses Ray, JSON or a socket.

Two places for the directory: shm, a private directory under /dev/shm (a memory copy; engines on rank 0's host
only, which must be the driver's: the driver makes the directory and reads the weights back), and the run directory
(rollout.sglang.weight_sync disk; every engine's node must see it).

A shm directory is named after the driver's pid (slime-dsa-weights-<pid>-<random>): a run that was SIGKILLed cannot
remove its model-sized copy, and the next run's remove_stale_shm_dirs removes those whose pid is gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import shutil
import weakref
from pathlib import Path
from typing import Any

from slime_dsa.orchestrator.weight_sync.base import WeightTransport, post_update, with_pause
from slime_dsa.weights.payloads import update_weights_from_disk_payload

logger = logging.getLogger(__name__)

SHM_ROOT = Path("/dev/shm")
WEIGHTS_FILE = "model.safetensors"
SHM_PREFIX = "slime-dsa-weights-"
_SHM_NAME = re.compile(rf"^{SHM_PREFIX}(\d+)-[0-9a-f]+$")


def shm_dir_name(shm_root: Path = SHM_ROOT) -> Path:
    """A fresh path for this process's weights under `shm_root` (not created): the pid, then a random part."""
    return shm_root / f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"


def remove_stale_shm_dirs(shm_root: Path = SHM_ROOT) -> list[Path]:
    """Remove the weight directories under `shm_root` whose run's pid is gone (left by a SIGKILLed run)."""
    removed = []
    for path in sorted(shm_root.glob(f"{SHM_PREFIX}*")) if shm_root.is_dir() else []:
        match = _SHM_NAME.match(path.name)
        if match is None or not path.is_dir() or _pid_alive(int(match.group(1))):
            continue  # not ours to judge, or its run still lives
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
            logger.info("removed %s, left by run pid %s, which is gone", path, match.group(1))
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


class DiskTransport(WeightTransport):
    """Rank 0 writes `directory`/model.safetensors; engines load `directory`. close() removes the directory."""

    def __init__(self, client: Any, trainers: Any, directory: Path, name: str = "disk") -> None:
        super().__init__(client, trainers)
        self.directory = directory
        self.name = name  # shm or disk: one mechanism, two places
        # The weights can be large (and in /dev/shm they are memory): freed even when the run dies before close().
        self._cleanup = weakref.finalize(self, shutil.rmtree, directory, True)

    @classmethod
    def in_shm(cls, client: Any, trainers: Any, model_dir: Path, shm_root: Path = SHM_ROOT,
               directory: Path | None = None) -> DiskTransport:
        """A private directory under `shm_root` (/dev/shm; `directory` when the engines were told it in advance, else a
        fresh shm_dir_name): engines on trainer rank 0's host read it from memory."""
        directory = Path(directory or shm_dir_name(shm_root))
        directory.mkdir(mode=0o700)
        return cls(client, trainers, _with_config(directory, model_dir), name="shm")

    @classmethod
    def in_directory(cls, client: Any, trainers: Any, model_dir: Path, directory: Path) -> DiskTransport:
        """`directory` (made if missing), which trainer rank 0 and every engine must see at the same path."""
        directory = directory.resolve()
        directory.mkdir(parents=True, exist_ok=True)
        return cls(client, trainers, _with_config(directory, model_dir))

    @property
    def path(self) -> Path:
        return self.directory / WEIGHTS_FILE

    async def prepare(self, version: int) -> None:
        await asyncio.to_thread(self.trainers.save_weights, str(self.path))

    one_request = True

    async def update(self, version: int, prepared: None, pause_mode: str | None = None) -> dict[str, Any]:
        body = update_weights_from_disk_payload(str(self.directory), weight_version=str(version))
        return await post_update(self.client, "/update_weights_from_disk", with_pause(body, pause_mode))

    async def read_state(self, prepared: None) -> dict:
        from safetensors.torch import load  # noqa: PLC0415

        return load(self.path.read_bytes())  # its own memory: the file is rewritten by the next version

    def close(self) -> None:
        self._cleanup()


def _with_config(directory: Path, model_dir: Path) -> Path:
    """`directory` with the model's config.json: a loadable HF directory."""
    if (model_dir / "config.json").exists():
        shutil.copy2(model_dir / "config.json", directory / "config.json")
    return directory
