"""http: the driver fetches the full state dict from trainer rank 0 and POSTs it in buckets to every engine's
/update_weights_from_tensor (load_format safetensors_b64). Works for embedded engines anywhere."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Mapping

from slime_dsa.orchestrator.weight_sync.base import WeightTransport, paused_update, post_update
from slime_dsa.weights.safetensors_b64 import tensor_update_payloads

if TYPE_CHECKING:
    import torch

DEFAULT_BUCKET_BYTES = 256 * 1024**2


async def send_tensors(client: Any, named_tensors: Mapping[str, torch.Tensor], version: int,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """POST the tensors to every engine in buckets; the last one flushes the prefix cache and sets the version."""
    for payload in tensor_update_payloads(named_tensors, weight_version=str(version), bucket_bytes=bucket_bytes):
        await post_update(client, "/update_weights_from_tensor", payload)


async def push_tensors(client: Any, named_tensors: Mapping[str, torch.Tensor], version: int,
                       pause_mode: str = "abort", bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """Given tensors (not a trainer's) to every engine of `client` as `version`: pause → update → continue."""
    await paused_update(client, lambda: send_tensors(client, named_tensors, version, bucket_bytes), pause_mode)


class HttpTransport(WeightTransport):
    """The state dict in /update_weights_from_tensor requests (base64 safetensors)."""

    name = "http"

    def __init__(self, client: Any, trainers: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        super().__init__(client, trainers)
        self.bucket_bytes = bucket_bytes

    async def prepare(self, version: int) -> dict[str, torch.Tensor]:
        return await asyncio.to_thread(self.trainers.full_state_dict)

    async def update(self, version: int, prepared: dict[str, torch.Tensor], pause_mode: str | None = None) -> None:
        await send_tensors(self.client, prepared, version, self.bucket_bytes)

    async def read_state(self, prepared: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return prepared
