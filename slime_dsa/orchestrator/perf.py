"""Per-step performance metrics of a run: the engines' step loops (perf/engine_*) and the trainers' model FLOPs
(perf/train_model_tflops, perf/train_mfu). Both loops log them through step.after_step."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.engine import perf as engine_perf
from slime_dsa.config import RecipeConfig

logger = logging.getLogger(__name__)


class EngineStats:
    """Reads every engine's step-loop counters (/get_server_info) and turns two readings into perf/engine_* metrics
    of the interval between them. Engines without the counters (SGLang servers) add nothing; an engine that joined
    since the last reading counts from its start.

    A reading the engines already sent (an embedded engine's weight-update reply, see `offer`) stands in for the
    next request when nothing can have run on the engines since: the synchronous loop's push right before its tail.
    """

    def __init__(self, client: Any, timeout_s: float = 30.0) -> None:
        self.client, self.timeout_s = client, timeout_s
        self._last: dict[str, dict[str, float]] = {}
        self._offered: dict[str, tuple[dict[str, float], int]] | None = None

    def offer(self, bodies: dict[str, Any] | None) -> None:
        """Replies ({url: body}) the engines sent at the end of their last command, for the next metrics() or reset()
        to read instead of /get_server_info. The caller vouches that no engine runs anything before that read. Taken
        only when they come from every engine of the client and each has the counters (else: the request)."""
        readings = _readings(bodies or {})
        complete = bool(readings) and set(readings) == set(bodies or {}) == set(self.client.engines)
        self._offered = readings if complete else None

    async def _read(self) -> dict[str, tuple[dict[str, float], int]]:
        offered, self._offered = self._offered, None
        if offered is not None:
            return offered
        bodies = await self.client.broadcast("/get_server_info", method="GET", check=False, timeout_s=self.timeout_s)
        return _readings(bodies)

    async def _read_or_none(self) -> dict[str, tuple[dict[str, float], int]] | None:
        try:
            return await self._read()
        except Exception as e:  # noqa: BLE001 (a metric must not stop the run; the engines' health is watched elsewhere)
            logger.warning("engine stats not read: %s: %s", type(e).__name__, e)
            return None

    async def reset(self) -> None:
        """Start a new interval now (what ran before is not counted: evaluation)."""
        now = await self._read_or_none()
        if now is not None:
            self._last = {url: c for url, (c, _) in now.items()}

    async def metrics(self) -> dict[str, float]:
        """perf/engine_* since the last reading or reset (rollout.engine.perf.step_metrics says what each is)."""
        now = await self._read_or_none()
        if now is None:
            return {}
        deltas = [engine_perf.delta(self._last.get(url), c) for url, (c, _) in now.items()]
        self._last = {url: c for url, (c, _) in now.items()}
        found = engine_perf.step_metrics(deltas, [m for _, m in now.values()])
        return {f"perf/engine_{k}": v for k, v in found.items()}


def _readings(bodies: dict[str, Any]) -> dict[str, tuple[dict[str, float], int]]:
    """{url: (counters, max_running_requests)} of the bodies that carry the counters (stats_*)."""
    readings = {}
    for url, body in bodies.items():
        found = engine_perf.counters(body, prefix="stats_") if isinstance(body, dict) else None
        if found is not None:
            readings[url] = (found, int(body.get("max_running_requests") or 1))
    return readings


@dataclass(frozen=True)
class TrainFlops:
    """What a trainer step's model FLOPs and MFU need: the policy's active parameters and one device's peak."""

    active_params: int
    peak_tflops: float | None  # per device; None: no MFU
    devices: int

    def metrics(self, tokens: int, seconds: float, recompute_forward: bool) -> dict[str, float]:
        """perf/train_model_tflops (per device) and, with a known peak, perf/train_mfu."""
        from slime_dsa.models.flops import train_flops  # noqa: PLC0415

        if seconds <= 0:
            return {}
        tflops = train_flops(self.active_params, tokens, recompute_forward) / seconds / self.devices / 1e12
        out = {"perf/train_model_tflops": tflops}
        if self.peak_tflops:
            out["perf/train_mfu"] = tflops / self.peak_tflops
        return out


def train_flops_for_run(recipe: RecipeConfig, model_dir: Path, trainers: Any) -> TrainFlops | None:
    """The run's TrainFlops: active parameters from the model's config, the peak from logging.peak_tflops or rank
    0's GPU name; None (a warning, no FLOPs metrics) when they cannot be found."""
    try:
        return _train_flops(recipe, model_dir, trainers)
    except Exception as e:  # noqa: BLE001 (a metric must not stop the run)
        logger.warning("no perf/train_model_tflops or perf/train_mfu: %s: %s", type(e).__name__, e)
        return None


def _train_flops(recipe: RecipeConfig, model_dir: Path, trainers: Any) -> TrainFlops:
    from slime_dsa.models import ModelConfig  # noqa: PLC0415
    from slime_dsa.models.flops import active_params, peak_tflops  # noqa: PLC0415

    active = active_params(ModelConfig.from_pretrained(model_dir))
    peak, name = recipe.logging.peak_tflops, None
    if peak is None:
        name = _device_name(trainers)
        peak = peak_tflops(name, bf16=recipe.trainer.mixed_precision)
    logger.info("MFU: 6·N per trained token (+2·N for a recomputed π_old), N = %.4gM active parameters; peak %s",
                active / 1e6, f"{peak:g} TFLOP/s per device" if peak else f"unknown ({name or 'CPU'}): no perf/train_mfu")
    return TrainFlops(active, peak, recipe.trainer.num_workers)


def _device_name(trainers: Any) -> str | None:
    """torch.cuda.get_device_name() on trainer rank 0, or None (CPU, or no worker to ask)."""
    import ray  # noqa: PLC0415

    workers = getattr(trainers, "workers", None)
    if not workers:
        return None
    return ray.get(workers[0].__ray_call__.remote(_cuda_name), timeout=60)


def _cuda_name(_actor: Any) -> str | None:
    import torch  # noqa: PLC0415

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None

