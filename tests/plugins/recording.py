"""Recording wrappers for algorithm specs (tests only): what each advantage function and loss got, as JSON lines.

The loss runs inside a trainer actor (another process), so it appends its records to a file the test reads back.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch


def _summary(t: torch.Tensor | None) -> Any:
    return None if t is None else [round(float(x), 6) for x in t.detach().float().flatten().tolist()]


@dataclasses.dataclass
class RecordingLoss:
    """Delegates to `inner` (a PolicyLoss) and appends its class, options and inputs to `path`."""

    inner: Any
    path: str

    @property
    def aggregation(self) -> str:
        return self.inner.aggregation

    def __call__(self, inputs):
        mask = inputs.loss_mask > 0
        record = {
            "loss": type(self.inner).__name__, "options": dataclasses.asdict(self.inner),
            "tokens": int(mask.sum()), "advantages": _summary(inputs.advantages[mask]),
            "has_old_logprobs": inputs.old_logprobs is not None,
            "has_rollout_logprobs": inputs.rollout_logprobs is not None,
            "old_equals_rollout": (inputs.old_logprobs is not None and inputs.rollout_logprobs is not None
                                   and bool(torch.equal(inputs.old_logprobs, inputs.rollout_logprobs))),
        }
        with Path(self.path).open("a") as f:
            f.write(json.dumps(record) + "\n")
        return self.inner(inputs)


def recording(spec_class: type, path: str) -> type:
    """A subclass of `spec_class` that records its advantage inputs and outputs and wraps its loss."""

    class Recording(spec_class):  # type: ignore[misc, valid-type]
        def advantages(self, inputs):
            out = super().advantages(inputs)
            record = {"rewards": _summary(inputs.rewards), "group_ids": inputs.group_ids.tolist(),
                      "advantages": _summary(out)}
            for name in ("loss_mask", "values", "final_values", "truncated"):  # a critic's per-token inputs
                if getattr(inputs, name) is not None:
                    record[name] = _summary(getattr(inputs, name))
            if inputs.sample_index is not None:
                record["sample_index"] = inputs.sample_index.tolist()
            with Path(path).with_suffix(".advantages.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")
            return out

        def policy_loss(self):
            return RecordingLoss(super().policy_loss(), path)

    Recording.__name__ = f"Recording{spec_class.__name__}"
    return Recording
