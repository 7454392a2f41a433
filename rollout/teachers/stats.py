"""What a teacher's scoring costs and how it went, counted per teacher and read by the loop once a step."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields


@dataclass
class TeacherStats:
    """Counters since the last reset; busy_s is the time the teacher had at least one request in flight."""

    requests: int = 0
    samples: int = 0  # samples scored
    tokens: int = 0  # input tokens the teacher computed (prompt + response), the prefill work
    response_tokens: int = 0  # tokens scored (the student's responses)
    busy_s: float = 0.0
    retried_samples: int = 0  # samples whose request failed once and went again
    failed_samples: int = 0  # samples given up on (the teacher never came back): marked failed, not trained on
    restarts: int = 0  # engines restarted after a crash
    swaps: int = 0  # times the teacher's weights were copied into a shared engine
    swap_s: float = 0.0
    _in_flight: int = 0
    _since: float = 0.0

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Count the block's time into busy_s, once however many requests overlap."""
        if self._in_flight == 0:
            self._since = time.perf_counter()
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self.busy_s += time.perf_counter() - self._since

    def metrics(self, prefix: str) -> dict[str, float]:
        """{prefix}/<counter> for every counter, and tok_s: input tokens per busy second."""
        out = {f"{prefix}/{f.name}": float(getattr(self, f.name)) for f in fields(self) if not f.name.startswith("_")}
        out[f"{prefix}/tok_s"] = self.tokens / self.busy_s if self.busy_s > 0 else 0.0
        if self.swaps:
            out[f"{prefix}/swap_time_mean_s"] = self.swap_s / self.swaps
        return out

    def reset(self) -> None:
        """Zero the counters (requests in flight stay counted as busy)."""
        in_flight, since = self._in_flight, time.perf_counter()
        for f in fields(self):
            setattr(self, f.name, f.default)
        self._in_flight, self._since = in_flight, since
