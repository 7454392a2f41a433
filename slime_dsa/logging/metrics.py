"""One place every metric goes through: metrics.jsonl (always), W&B (online/offline/disabled), the console."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from slime_dsa.durable import fsync_path, write_atomic

logger = logging.getLogger(__name__)


def resolve_wandb_mode(mode: str) -> str:
    """'auto' is online with a WANDB_API_KEY (or a wandb login), offline otherwise."""
    if mode != "auto":
        return mode
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class MetricsLogger:
    """Writes each step's metrics to metrics.jsonl and W&B; on resume, drops lines past the resumed step. The W&B run
    keeps the steps an interrupted session logged past it (a run's steps only increase, and rewinding a run is a W&B
    preview feature), so the resumed session logs to W&B from the step after them.

    Each metrics.jsonl record also has `time` (unix seconds when it was logged) and `elapsed_s` (seconds of the run
    so far: since logging began, continued from the last kept record on resume, so downtime is not counted).
    W&B keeps its own clock and gets neither."""

    def __init__(self, run_dir: str | Path, project: str, run_name: str | None, wandb_mode: str = "auto",
                 config: dict[str, Any] | None = None, resume_step: int | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        elapsed_before, newest_dropped = self._truncate_after(resume_step) if resume_step is not None else (0.0, None)
        self._start = time.monotonic() - elapsed_before
        self._file = self.path.open("a")
        fresh = resume_step is not None and resume_step < 0  # a resume that kept no step starts over
        self._wandb_holds_through = None if fresh else newest_dropped
        self.wandb_run = None
        mode = resolve_wandb_mode(wandb_mode)
        if mode != "disabled":
            self.wandb_run = self._init_wandb(project, run_name, mode, config or {}, fresh)
            if self._wandb_holds_through is not None:
                logger.warning("W&B run %s keeps steps %d-%d as the interrupted session logged them (W&B steps only "
                               "increase): this session logs to it from step %d; metrics.jsonl holds its every step",
                               self.wandb_run.id, resume_step + 1, newest_dropped, newest_dropped + 1)

    def _init_wandb(self, project: str, run_name: str | None, mode: str, config: dict[str, Any], fresh: bool = False):
        import wandb  # noqa: PLC0415 (slow import, only when used)

        id_file = self.run_dir / "wandb_run_id.txt"
        run_id = wandb_run_id(id_file.read_text().strip() if id_file.exists() else None, fresh)
        write_atomic(id_file, run_id)
        try:
            run = wandb.init(project=project, name=run_name, id=run_id, dir=str(self.run_dir), mode=mode,
                             config=config, reinit="finish_previous", resume="allow")
        except wandb.errors.UsageError as e:  # online without an API key or a `wandb login`
            from slime_dsa.config.errors import UserError  # noqa: PLC0415

            raise UserError(f"logging.wandb_mode {mode}: W&B did not start: {e} (set WANDB_API_KEY, run `wandb "
                            "login`, or use logging.wandb_mode offline)") from None
        except wandb.errors.CommError as e:  # online, W&B's server not reached within wandb's init_timeout
            from slime_dsa.config.errors import UserError  # noqa: PLC0415

            reason = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
            raise UserError(f"logging.wandb_mode {mode}: W&B's server did not answer: {reason} (check the network, or "
                            "use logging.wandb_mode offline and `wandb sync` the run later)") from None
        logger.info("wandb run %s (%s) in %s", run_id, mode, self.run_dir)
        return run

    def _truncate_after(self, step: int) -> tuple[float, int | None]:
        """Drop the records past `step`; returns (the elapsed_s of the last one kept or 0, the newest step dropped or
        None)."""
        if not self.path.exists():
            return 0.0, None
        records = _records(self.path)
        kept = [(line, r) for line, r in records if r.get("step", 0) <= step]
        write_atomic(self.path, "".join(line + "\n" for line, _ in kept))  # a failed rewrite must lose no record
        elapsed = max((float(r["elapsed_s"]) for _, r in kept if isinstance(r.get("elapsed_s"), (int, float))),
                      default=0.0)
        return elapsed, max((r.get("step", 0) for _, r in records if r.get("step", 0) > step), default=None)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Record metrics for a step; non-finite values are kept as strings in JSON so nothing is lost."""
        clean = {k: _plain(v) for k, v in metrics.items()}
        clock = {"time": round(time.time(), 3), "elapsed_s": round(time.monotonic() - self._start, 3)}
        self._file.write(json.dumps({"step": step, **clock, **clean}) + "\n")
        self._file.flush()
        if self.wandb_run is not None and (self._wandb_holds_through is None or step > self._wandb_holds_through):
            self.wandb_run.log({k: v for k, v in clean.items() if isinstance(v, (int, float))}, step=step)

    def sync(self) -> None:
        """fsync metrics.jsonl, so that its records survive a power loss (called before each checkpoint)."""
        fsync_path(self.path)

    def close(self) -> None:
        """Close metrics.jsonl and finish the W&B run: failed (exit code 1) when called as an exception leaves, so a
        crashed or interrupted run does not show as finished."""
        self._file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=0 if sys.exc_info()[0] is None else 1)
            self.wandb_run = None


def wandb_run_id(run_id: str | None, fresh: bool) -> str:
    """The run directory's W&B run id, continued; a new one without it or for a resume that kept no step."""
    return uuid.uuid4().hex[:12] if run_id is None or fresh else run_id


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of a run's metrics.jsonl, in order."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    return [record for _, record in _records(path)]


def _records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, record) for each line of a metrics.jsonl. A line that is not a JSON record, such as the torn last line
    of a run killed while writing it or stopped by a full disk, is skipped with a warning."""
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict):
            records.append((line, record))
        else:
            logger.warning("%s line %d is not a JSON record (a run stopped while writing it?): skipped", path, number)
    return records
