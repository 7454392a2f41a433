"""`slime-dsa report RUN_DIR`: the main curves of a run as PNG files."""

from __future__ import annotations

from pathlib import Path

from slime_dsa.config.errors import UserError
from slime_dsa.logging.metrics import read_metrics

PANELS = {
    "reward.png": ("Reward", ["rollout/reward_mean", "eval/reward_mean", "eval/pass@1"]),
    "loss.png": ("Policy loss", ["train/loss", "train/pg_clipfrac", "train/entropy"]),
    "logprob_diff.png": ("Trainer vs rollout log-prob gap", ["train/train_rollout_logprob_abs_diff"]),
    "response_length.png": ("Response length", ["rollout/response_length_mean"]),
    "step_time.png": ("Step time (s)", ["perf/step_time_s", "perf/rollout_time_s", "perf/train_time_s", "perf/sync_time_s"]),
}


def render_report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write one PNG per panel that has data; returns the files written."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist")
    if not (run_dir / "metrics.jsonl").is_file():
        raise UserError(f"{run_dir} holds no metrics.jsonl: is it a run directory?")
    records = read_metrics(run_dir)
    out = Path(out_dir or Path(run_dir) / "report")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, (title, keys) in PANELS.items():
        series = {k: [(r["step"], r[k]) for r in records if isinstance(r.get(k), (int, float))] for k in keys}
        series = {k: v for k, v in series.items() if v}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, points in series.items():
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o" if len(points) < 30 else None, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=110)
        plt.close(fig)
        written.append(out / filename)
    return written
