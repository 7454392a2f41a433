"""Where one rollout phase's wall time goes on the driver: the /generate window, the calls' round trips against
the engines' own time for them, and the host work on the answers (assembly, rewards).

The driver runs on one event loop, so the summed host sections (assembly, inline rewards) are time the loop was
busy; the round trips overlap each other, so only their means and the window they span are wall time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class RolloutClock:
    """Stamps and sums of one rollout phase (`start` it, then the group code records each call and section)."""

    started: float | None = None
    first_sent: float | None = None  # the first /generate call's start
    last_answered: float | None = None  # the last /generate call's answer
    calls: int = 0  # /generate calls answered
    call_s: float = 0.0  # summed round trips, as the driver saw them
    server_s: float = 0.0  # summed e2e_latency the engines reported for those calls (their own time on them)
    assemble_s: float = 0.0  # samples filled from the answers (ids, log-probs, detokenisation, replay rows)
    reward_s: float = 0.0  # reward calls, from start to result

    def start(self) -> None:
        """Forget everything: a new phase starts now."""
        self.__init__()  # type: ignore[misc]
        self.started = time.perf_counter()

    def sent(self) -> float:
        """Stamp a call's start; returns it for `answered`."""
        now = time.perf_counter()
        if self.first_sent is None:
            self.first_sent = now
        return now

    def answered(self, sent_at: float, server_s: float | None) -> None:
        """A call started at `sent_at` answered now; `server_s`: the engine's e2e_latency for it, if it said."""
        now = time.perf_counter()
        self.last_answered = now
        self.calls += 1
        self.call_s += now - sent_at
        self.server_s += server_s if server_s is not None else now - sent_at

    def metrics(self, end: float | None = None) -> dict[str, float]:
        """perf/rollout_* of the phase up to `end` (default now); {} when it was not started or made no call.

        dispatch_s: start to the first call; generate_s: first call to last answer; tail_s: last answer to `end`;
        call_ms / transport_ms: mean round trip, and its part outside the engine's own time (HTTP, JSON, queueing on
        the driver's event loop); assemble_s, reward_s: summed host time."""
        if self.started is None or self.first_sent is None or self.last_answered is None:
            return {}
        end = time.perf_counter() if end is None else end
        calls = max(self.calls, 1)
        return {
            "perf/rollout_dispatch_s": self.first_sent - self.started,
            "perf/rollout_generate_s": self.last_answered - self.first_sent,
            "perf/rollout_tail_s": max(0.0, end - self.last_answered),
            "perf/rollout_calls": float(self.calls),
            "perf/rollout_call_ms": self.call_s / calls * 1e3,
            "perf/rollout_transport_ms": max(0.0, self.call_s - self.server_s) / calls * 1e3,
            "perf/rollout_assemble_s": self.assemble_s,
            "perf/rollout_reward_s": self.reward_s,
        }
