"""distributed: SGLang's update from distributed. Trainer rank 0 and every engine rank form one process group
(NCCL; gloo in CPU tests); per bucket the driver POSTs /update_weights_from_distributed (names, dtypes, shapes)
while rank 0 broadcasts those tensors in that order. Engines anywhere; the weights never touch the driver.

The group is formed at the first push: POST /init_weights_update_group to every engine while rank 0 joins.
"""

from __future__ import annotations

import asyncio
from typing import Any

from slime_dsa.orchestrator.weight_sync.base import WeightTransport, check_replies, post_update
from slime_dsa.weights.payloads import (
    DEFAULT_GROUP, TensorSpec, init_weights_update_group_payload, update_weights_from_distributed_payload,
)

DEFAULT_BUCKET_BYTES = 1024**3


class DistributedTransport(WeightTransport):
    """A broadcast from trainer rank 0 to the engines' ranks (`ranks_per_engine` each: SGLang's tp size)."""

    name = "distributed"

    def __init__(self, client: Any, trainers: Any, ranks_per_engine: int = 1, engine_dtype: str | None = None,
                 backend: str = "nccl", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 group_name: str = DEFAULT_GROUP) -> None:
        super().__init__(client, trainers)
        self.ranks_per_engine, self.engine_dtype, self.backend = ranks_per_engine, engine_dtype, backend
        self.bucket_bytes, self.group_name = bucket_bytes, group_name
        self.buckets: list[list[TensorSpec]] | None = None  # set when the group is formed
        self.group_urls: list[str] = []  # the engines in the group, in rank order

    async def prepare(self, version: int) -> None:
        if self.buckets is None:
            await self._form_group()
            self.buckets = await asyncio.to_thread(self.trainers.weight_buckets, self.engine_dtype, self.bucket_bytes)

    async def _form_group(self) -> None:
        """Every engine and trainer rank 0 join one group; each side blocks until all have."""
        address, port = await asyncio.to_thread(self.trainers.weight_group_address)
        urls = self.group_urls = list(self.client.engines)
        world_size = 1 + self.ranks_per_engine * len(urls)

        async def init(i: int, url: str) -> None:
            payload = init_weights_update_group_payload(address, port, 1 + i * self.ranks_per_engine, world_size,
                                                        self.group_name, self.backend)
            reply = await self.client.post_to(url, "/init_weights_update_group", payload)
            check_replies("/init_weights_update_group", {url: reply})

        join = asyncio.to_thread(self.trainers.join_weight_group, address, port, world_size, self.group_name,
                                 self.backend)
        await asyncio.gather(join, *(init(i, url) for i, url in enumerate(urls)))

    async def update(self, version: int, prepared: None, pause_mode: str | None = None) -> None:
        from rollout.client import EngineLossError  # noqa: PLC0415

        if gone := [url for url in self.group_urls if url not in self.client.engines]:
            raise EngineLossError(f"engine {gone[0]} was lost, and the distributed weight group (NCCL) cannot go on "
                                  f"without its ranks")

        async def announce() -> None:  # each POST returns once the engines have received that bucket
            for i, bucket in enumerate(self.buckets):
                last = i == len(self.buckets) - 1
                payload = update_weights_from_distributed_payload(
                    bucket, group_name=self.group_name, flush_cache=last, weight_version=str(version) if last else None)
                await post_update(self.client, "/update_weights_from_distributed", payload)

        await asyncio.gather(announce(), asyncio.to_thread(self.trainers.broadcast_weights, self.buckets))
