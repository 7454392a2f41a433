"""`slime-dsa report RUN_DIR`: the main curves of a run as PNG files, one quantity (one unit) per plot.

Each panel is drawn when metrics.jsonl has any of its keys; the reward is drawn a second time against wall-clock
time (`elapsed_s`, records written since metrics carry it).
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from slime_dsa.config.errors import UserError
from slime_dsa.durable import write_failure
from slime_dsa.logging.metrics import read_metrics


@dataclass(frozen=True)
class Panel:
    """One PNG: the keys drawn, on which x axis, with which labels."""

    filename: str
    title: str
    ylabel: str
    keys: tuple[str, ...]
    x_key: str = "step"
    xlabel: str = "step"
    x_scale: float = 1.0  # x values are divided by this (seconds -> minutes)
    log_y: bool = False
    pattern: str | None = None  # also every key that matches this glob (one line per task, domain, teacher)


PANELS = (
    Panel("reward.png", "Reward", "mean reward", ("rollout/reward_mean", "eval/reward_mean")),
    Panel("reward_vs_time.png", "Reward over wall-clock time", "mean reward",
          ("rollout/reward_mean", "eval/reward_mean"), x_key="elapsed_s", xlabel="wall-clock time of the run (min)",
          x_scale=60.0),
    Panel("pass_at_1.png", "Eval pass@1 (greedy)", "share of eval prompts solved", ("eval/pass@1",)),
    Panel("loss.png", "Policy loss", "loss", ("train/loss", "train/pg_loss")),
    Panel("entropy.png", "Policy entropy", "entropy (nats per token)", ("train/entropy",)),
    Panel("clipfrac.png", "Clipped tokens", "share of tokens clipped", ("train/pg_clipfrac",)),
    Panel("kl.png", "KL divergence", "KL (nats per token)", ("train/approx_kl", "train/kl_ref")),
    Panel("grad_norm.png", "Gradient norm", "global grad norm (before clipping)", ("train/grad_norm",)),
    Panel("learning_rate.png", "Learning rate", "learning rate", ("train/lr",)),
    Panel("zero_std_groups.png", "Groups whose rewards all agree (no advantage)", "groups per step",
          ("rollout/zero_std_groups",)),
    Panel("logprob_diff.png", "Trainer vs rollout log-prob gap", "mean |Δ log-prob| per token",
          ("train/train_rollout_logprob_abs_diff",), log_y=True),
    Panel("response_length.png", "Response length", "tokens", ("rollout/response_length_mean",)),
    Panel("value_loss.png", "Critic value loss", "masked MSE", ("critic/value_loss",)),
    Panel("explained_variance.png", "Critic explained variance (V_old vs targets)", "1 - Var(R - V) / Var(R)",
          ("critic/explained_variance",)),
    Panel("advantage.png", "Advantages over action tokens", "advantage", ("advantage/mean", "advantage/std")),
    Panel("step_time.png", "Step time", "seconds",
          ("perf/step_time_s", "perf/rollout_time_s", "perf/train_time_s", "perf/sync_time_s")),
    Panel("staleness.png", "Staleness of the trained samples (asynchronous loop)", "policy versions behind",
          ("async/staleness_mean", "async/staleness_max")),
    Panel("dis_frac.png", "Tokens outside the double-sided IS band (no gradient)", "share of tokens",
          ("train/dis_frac_below", "train/dis_frac_above")),
    Panel("indexer_kl.png", "DSA indexer loss", "KL(attention ‖ indexer) per row",
          ("train/indexer_kl", "indexer_warmup/indexer_kl", "indexer_warmup/eval/indexer_kl"), log_y=True),
    Panel("indexer_recall.png", "DSA indexer recall of the attention (held-out windows)", "recall at index_topk",
          ("indexer_warmup/eval/recall",)),
    Panel("pass_at_1_by_task.png", "Eval pass@1 (greedy) per task", "share of eval prompts solved", (),
          pattern="eval/*/pass@1"),
    Panel("reverse_kl_by_domain.png", "Reverse KL to each domain's teacher (on-policy distillation)",
          "log π_student − log π_teacher per token", (), pattern="opd/*/reverse_kl"),
)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def panel_series(panel: Panel, records: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """{key: [(x, y), ...]} of the panel's keys (and those matching its pattern) that have data, x in the panel's unit."""
    keys = list(panel.keys)
    if panel.pattern:
        keys += sorted({k for r in records for k in r if fnmatchcase(k, panel.pattern)} - set(keys))
    series = {k: [(r[panel.x_key] / panel.x_scale, r[k]) for r in records if _number(r.get(k)) and _number(r.get(panel.x_key))]
              for k in keys}
    return {k: v for k, v in series.items() if v}


def plan_panels(records: list[dict[str, Any]]) -> list[Panel]:
    """The panels that have data in these records."""
    return [p for p in PANELS if panel_series(p, records)]


def render_report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write one PNG per panel that has data; returns the files written."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is a file, not a run directory" if run_dir.exists()
                        else f"run directory {run_dir} does not exist")
    if not (run_dir / "metrics.jsonl").is_file():
        raise UserError(f"{run_dir} holds no metrics.jsonl: is it a run directory?")
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    records = read_metrics(run_dir)
    if not records:
        raise UserError(f"{run_dir / 'metrics.jsonl'} holds no records yet: nothing to plot")
    panels = plan_panels(records)
    if not panels:  # else an empty report directory and exit 0
        raise UserError(f"{run_dir / 'metrics.jsonl'} holds none of the keys the report draws")
    out = Path(out_dir or run_dir / "report")
    try:
        return _draw(panels, records, out, plt)
    except OSError as e:  # out under a file, unwritable, a full disk
        raise UserError(f"{'--out ' if out_dir else 'report directory '}{out}: {write_failure(out, e)}") from None


def _draw(panels: list[Panel], records: list[dict[str, Any]], out: Path, plt: Any) -> list[Path]:
    """One PNG per panel into `out` (made if missing); the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for panel in panels:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, points in panel_series(panel, records).items():
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o" if len(points) < 30 else None, markersize=3, label=key)
        if panel.log_y and all(y > 0 for line in ax.get_lines() for y in line.get_ydata()):
            ax.set_yscale("log")
        ax.set_title(panel.title)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / panel.filename, dpi=110)
        plt.close(fig)
        written.append(out / panel.filename)
    return written
