"""Engines and trainers colocated on GPUs take turns: around each training call the engines are paused and hand
their KV cache to the trainer, then take it back (cluster.engine_kv_cache_in_training); after it the trainer gives
its allocator's cached memory back to the engines (cluster.trainer_cache_in_rollout).

Releasing the cache also drops an embedded engine's decode CUDA graphs (they hold the pool's addresses), so each
rollout after a release re-allocates the pool and captures its graphs again. When the pool is small next to the GPU
the memory is not worth that: auto keeps it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Literal

logger = logging.getLogger(__name__)

KEEP_SHARE = 0.10  # auto keeps a KV cache of at most this share of its GPU's memory
# auto keeps the trainer's cache while this share of the GPU stays free for the engines' activations and graphs
# (SGLang leaves about 12% outside its static pool for the same).
ENGINE_ROOM_SHARE = 0.15
KvCacheMode = Literal["auto", "release", "keep"]


def keeps_kv_cache(mode: KvCacheMode, server_infos: dict[str, Any]) -> bool:
    """Whether the engines keep their KV cache while the trainer steps: `mode` keep or release, or for auto, every
    engine reporting a cache of at most KEEP_SHARE of its GPU (an engine that does not say, e.g. SGLang: release)."""
    if mode != "auto":
        return mode == "keep"
    shares = [_kv_share(info) for info in server_infos.values()]
    return bool(shares) and all(share is not None and share <= KEEP_SHARE for share in shares)


def _kv_share(info: Any) -> float | None:
    if not isinstance(info, dict):
        return None
    kv, total = info.get("kv_cache_bytes"), info.get("device_memory_bytes")
    if not isinstance(kv, (int, float)) or not isinstance(total, (int, float)) or total <= 0:
        return None
    return kv / total


class MemoryHandOver:
    """The pause and memory calls around one training call of colocated engines and trainers. The keep-or-release
    choice is made once, at the first hand-over, from the engines' /get_server_info."""

    def __init__(self, client: Any, trainers: Any, mode: KvCacheMode = "auto",
                 trainer_mode: KvCacheMode = "auto") -> None:
        self.client, self.trainers, self.mode, self.trainer_mode = client, trainers, mode, trainer_mode
        self.keep: bool | None = None  # decided at the first to_trainer

    def trainer_min_free_share(self) -> float | None:
        """What the trainers' release_memory gets: None releases always, else only below that free share. While the
        engines release their KV cache they take it back after the trainer: auto releases then."""
        if self.trainer_mode == "auto":
            return ENGINE_ROOM_SHARE if self.keep else None
        return 0.0 if self.trainer_mode == "keep" else None

    async def _decide(self) -> bool:
        infos = {} if self.mode != "auto" else await self.client.broadcast("/get_server_info", method="GET",
                                                                            check=False, timeout_s=30)
        keep = keeps_kv_cache(self.mode, infos)
        sizes = ", ".join(f"{_gib(i.get('kv_cache_bytes'))} of {_gib(i.get('device_memory_bytes'))} GiB"
                          for i in infos.values() if isinstance(i, dict))
        logger.info("colocated engines %s their KV cache while the trainer steps (cluster.engine_kv_cache_in_training "
                    "%s%s); the trainer's cached memory: %s (cluster.trainer_cache_in_rollout)", "keep" if keep else
                    "release", self.mode, f": {sizes}" if sizes else "",
                    {"auto": f"kept while {ENGINE_ROOM_SHARE:.0%} of the GPU is free" if keep else "released",
                     "keep": "kept", "release": "released"}[self.trainer_mode])
        return keep

    async def to_trainer(self) -> None:
        """Pause the engines; unless they keep it, their KV cache goes to the trainer."""
        if self.keep is None:
            self.keep = await self._decide()
        await self.client.broadcast("/pause_generation", {"mode": "retract"})
        if not self.keep:
            await self.client.broadcast("/release_memory_occupation", {"tags": ["kv_cache"]})
            await asyncio.to_thread(self.trainers.resume_memory)

    async def to_engines(self, resume: bool = True,
                         release: Callable[[float | None], Awaitable[None]] | None = None) -> None:
        """The trainer's cached memory back to the device (unless `trainer_min_free_share` lets it keep it), the KV cache
        back to the engines unless they kept it; generation continues, or with `resume` False stays paused for the
        caller's next call to continue it (a weight push, which continues the engines itself). `release`: what
        releases the trainer's memory instead of trainers.release_memory (a transport's call that also prepares
        its push: CudaIpcTransport.release_and_prepare)."""
        min_free_share = self.trainer_min_free_share()
        if release is not None:
            await release(min_free_share)
        else:
            await asyncio.to_thread(self.trainers.release_memory, min_free_share)
        if not self.keep:
            await self.client.broadcast("/resume_memory_occupation", {"tags": ["kv_cache"]})
        if resume:
            await self.client.broadcast("/continue_generation", {})


def _gib(n: Any) -> str:
    return f"{n / 2**30:.2f}" if isinstance(n, (int, float)) else "?"
