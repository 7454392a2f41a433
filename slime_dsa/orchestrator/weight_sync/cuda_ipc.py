"""cuda_ipc: trainer rank 0 copies the weights, cast to the engines' dtypes, into one buffer on its GPU; every
engine on that same GPU copies them out device to device, through a CUDA IPC handle sent as a JSON table to
/update_weights_from_tensor (load_format cuda_ipc; slime_dsa.weights.cuda_ipc). Nothing touches host memory."""

from __future__ import annotations

import asyncio
from typing import Any

from slime_dsa.orchestrator.weight_sync.base import WeightTransport, post_update, with_pause
from slime_dsa.weights.cuda_ipc import LOAD_FORMAT_CUDA_IPC


class CudaIpcTransport(WeightTransport):
    """Rank 0's shared GPU buffer, opened by embedded engines on its GPU."""

    name = "cuda_ipc"

    def __init__(self, client: Any, trainers: Any, engine_dtype: str) -> None:
        super().__init__(client, trainers)
        self.engine_dtype = engine_dtype  # the engines' dtype, which rank 0 casts to
        self._filled: dict | None = None  # the table of a buffer filled by release_and_prepare, for the next push

    async def release_and_prepare(self, min_free_share: float | None = None) -> None:
        """The trainers' release_memory, with the next push's buffer fill in the same Ray call per rank (colocated:
        the push follows the training call at once, the weights as they are now). Two calls when the trainers
        have no combined one."""
        combined = getattr(self.trainers, "release_memory_and_share_weights", None)
        if combined is None:
            await asyncio.to_thread(self.trainers.release_memory, min_free_share)
            return
        self._filled = await asyncio.to_thread(combined, self.engine_dtype, min_free_share)

    async def prepare(self, version: int) -> dict:
        if self._filled is not None:
            table, self._filled = self._filled, None
            return table
        # The engines read the buffer only during the update, so rank 0 refills it while they still generate.
        return await asyncio.to_thread(self.trainers.share_weights, self.engine_dtype)

    one_request = True

    async def update(self, version: int, prepared: dict, pause_mode: str | None = None) -> dict[str, Any]:
        body = {"serialized_named_tensors": [prepared], "load_format": LOAD_FORMAT_CUDA_IPC, "flush_cache": True,
                "weight_version": str(version)}
        return await post_update(self.client, "/update_weights_from_tensor", with_pause(body, pause_mode))
