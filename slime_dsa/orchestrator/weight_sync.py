"""New weights to every engine after a training step: pause → update (bucketed) → resume, with a version."""

from __future__ import annotations

import logging
import time

import torch

from rollout.client import EngineClient
from rollout.server.weights import tensor_update_payloads

logger = logging.getLogger(__name__)


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
