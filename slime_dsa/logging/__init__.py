"""Run logging: W&B, metrics.jsonl in the run directory, rich console progress, and PNG reports."""

from slime_dsa.logging.metrics import MetricsLogger, resolve_wandb_mode

__all__ = ["MetricsLogger", "resolve_wandb_mode"]
