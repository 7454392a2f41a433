"""logging.profile_steps: a torch.profiler trace of each listed RL step from every engine (POST /start_profile,
/stop_profile) and trainer rank, with the orchestrator's phase times, in <run_dir>/profile/step_<N>/; read them
with `python -m slime_dsa.logging.timeline`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from slime_dsa.logging.timeline import PHASES_FILE, busy_share
from slime_dsa.trace_recorder import ACTIVITIES

logger = logging.getLogger(__name__)


class PhaseClock:
    """The wall-clock bounds of a step's phases, in order: mark(name) ends the phase `name` now."""

    def __init__(self) -> None:
        self.start_ns = time.time_ns()
        self.phases: list[dict[str, Any]] = []

    def mark(self, name: str) -> None:
        start = self.phases[-1]["end_ns"] if self.phases else self.start_ns
        self.phases.append({"name": name, "start_ns": start, "end_ns": time.time_ns()})


class StepProfiler:
    """Starts and stops the profilers of a run's engines and trainer ranks around the steps it lists."""

    def __init__(self, steps: list[int], run_dir: Path, client: Any, trainers: Any,
                 activities: Sequence[str] = ACTIVITIES) -> None:
        self.steps, self.root, self.activities = set(steps), run_dir / "profile", list(activities)
        self.client, self.trainers = client, trainers

    @contextlib.asynccontextmanager
    async def window(self, step: int) -> AsyncIterator[PhaseClock]:
        """Around RL step `step` (1-based): yields its PhaseClock; traces only when the step is listed. A process
        that cannot be profiled costs its trace and a warning, never the step."""
        if step not in self.steps:
            yield PhaseClock()
            return
        directory = self.root / f"step_{step}"
        directory.mkdir(parents=True, exist_ok=True)
        await self._call("start", directory)
        clock = PhaseClock()
        try:
            yield clock
        finally:
            await self._call("stop", directory)
            (directory / PHASES_FILE).write_text(json.dumps({"step": step, "phases": clock.phases}))
            self._log(step, directory)

    async def _call(self, action: str, directory: Path) -> None:
        from rollout.client import EngineError  # noqa: PLC0415

        body = {"output_dir": str(directory), "activities": self.activities} if action == "start" else {}
        try:
            await self.client.broadcast(f"/{action}_profile", body)
        except EngineError as e:  # every engine got the call; those named here did not do it
            logger.warning("engines did not %s their profiles: %s", action, e)
        try:
            if action == "start":
                await asyncio.to_thread(self.trainers.start_profile, str(directory), self.activities)
            else:
                await asyncio.to_thread(self.trainers.stop_profile)
        except Exception as e:  # noqa: BLE001 (a profile is a diagnostic: the run goes on without it)
            logger.warning("the trainer ranks did not %s their profiles: %s", action, e)

    @staticmethod
    def _log(step: int, directory: Path) -> None:
        try:
            shares = busy_share(directory)
        except (OSError, ValueError, KeyError) as e:
            logger.warning("step %d profile in %s could not be read: %s", step, directory, e)
            return
        if not shares:
            logger.info("step %d profiled (no GPU activity) -> %s", step, directory)
            return
        phases = ", ".join(f"{name} {100 * share:.0f}%" for name, share in shares.items() if name != "step")
        logger.info("step %d profiled: GPU busy %.0f%% of the step (%s) -> %s; where it sat idle: python -m "
                    "slime_dsa.logging.timeline %s", step, 100 * shares["step"], phases, directory, directory)
