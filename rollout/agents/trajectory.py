"""`Trajectory`: one sample growing turn by turn, token in, token out, within its limits.

Each turn's /generate gets the whole id sequence so far (prompt + earlier model ids + tool ids), never text, so the
trainer sees exactly the ids the engine sampled, with their log-probs; the turns of a trajectory share a session,
so they reach one engine and reuse its prefix cache. With index replay, turn k asks for the top-k of the rows from
the first one earlier turns did not cover (the last model token of turn k-1, then the tool tokens), and the rows
are joined into one array over every row of the trajectory, as Sample.validate wants.

Limits: before a turn, the turn count, the token budget (the whole response, model and tool tokens) and the wall
time; a turn cut at its token budget ends the trajectory too. A trajectory cut by a limit ends TRUNCATED with
metadata["truncated_by"]; tool tokens after the last model turn are dropped first, so it always ends with a model
token (where GAE bootstraps from the value model). A failed generation ends it FAILED; an aborted one ABORTED.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rollout.agents.base import AgentEnv, TruncatedBy
from rollout.client import EngineError, MalformedResponseError, indexer_topk_rows
from rollout.tools.base import ToolResult, call_tool
from slime_dsa.data.sample import Sample, SampleStatus
from slime_dsa.data.tool_calls import ToolCall

logger = logging.getLogger(__name__)

_TURN_SEED_STRIDE = 1_000_003  # turn k of a trajectory samples with seed + k * stride


@dataclass(frozen=True)
class Turn:
    """One model turn: its ids, its text (special tokens left out) and why the engine stopped."""

    ids: list[int]
    text: str
    finish: str  # stop | length | abort


class Trajectory:
    """Builds one trajectory in `sample` (which must be fresh: prompt only)."""

    def __init__(self, sample: Sample, env: AgentEnv) -> None:
        if sample.response_ids:
            raise ValueError(f"sample {sample.index}: an agent trajectory starts from the prompt alone")
        self.sample, self.env = sample, env
        self.started = time.monotonic()
        self.turns = 0
        self.done = False
        self.last_text = ""
        self.tool_status: Counter[str] = Counter()
        self._topk: np.ndarray | None = None
        self._topk_start: int | None = None
        self._observation_from: int | None = None  # response length before the tool tokens not yet followed by a turn

    @property
    def remaining_s(self) -> float:
        return self.env.limits.max_wall_time_s - (time.monotonic() - self.started)

    @property
    def remaining_tokens(self) -> int:
        return self.env.limits.max_tokens - len(self.sample.response_ids)

    async def generate(self) -> Turn | None:
        """Append one model turn; None when the trajectory ended before it (a limit, a failure). A turn that ends
        the trajectory (cut at its budget, aborted) is returned and `done` is set."""
        limits = self.env.limits
        if self.turns >= limits.max_turns:
            return self.truncate("turns")
        budget = min(limits.max_turn_tokens or math.inf, self.remaining_tokens)
        if budget <= 0:
            return self.truncate("tokens")
        if self.remaining_s <= 0:
            return self.truncate("wall_time")
        try:
            out = await asyncio.wait_for(self._request(int(budget)), self.remaining_s)
        except asyncio.TimeoutError:
            if self.remaining_s <= 0:
                return self.truncate("wall_time")
            return self.fail("generation timed out")
        except EngineError as e:
            return self.fail(f"{type(e).__name__}: {e}")
        return self._append_turn(out)

    async def _request(self, budget: int) -> dict:
        env = self.env
        params = dict(env.sampling_params)
        params["max_new_tokens"] = budget
        params["sampling_seed"] = (env.seed + self.turns * _TURN_SEED_STRIDE) % 2**31
        params["stop_token_ids"] = sorted({*params.get("stop_token_ids", ()), *env.format.stop_token_ids})
        first_uncovered = 0 if self._topk is None else self._topk_start + len(self._topk)
        return await self.env.client.generate(
            self.sample.tokens, params, return_logprob=True, session_id=env.session_id,
            return_indexer_topk=env.return_indexer_topk, indexer_topk_start_len=first_uncovered,
            timeout_s=min(env.request_timeout_s, max(self.remaining_s, 1e-3)))

    def _append_turn(self, out: dict) -> Turn | None:
        meta = out["meta_info"]
        ids = [int(tok) for _, tok, *_ in meta["output_token_logprobs"]]
        logprobs = [float(lp) for lp, *_ in meta["output_token_logprobs"]]
        versions = meta.get("output_token_versions") or [int(meta.get("weight_version") or 0)] * len(ids)
        finish = (meta.get("finish_reason") or {}).get("type") or "stop"
        if self.env.return_indexer_topk and finish != "abort":
            try:
                self._add_topk(*indexer_topk_rows(meta))
            except MalformedResponseError as e:
                return self.fail(str(e))
        self.sample.append_tokens(ids, logprobs, [int(v) for v in versions])
        self._observation_from = None
        self.turns += 1
        turn = Turn(ids, self.env.tokenizer.decode(ids, skip_special_tokens=True), finish)
        self.last_text = turn.text
        if finish == "abort":
            self.done = True
            self.sample.status = SampleStatus.ABORTED
            self._topk = None
        elif finish == "length":
            self.truncate("tokens")
        return turn

    def _add_topk(self, rows: np.ndarray | None, start: int | None) -> None:
        """Join a turn's top-k rows to the trajectory's (rows before `start` below index_topk need none)."""
        if rows is None:
            raise MalformedResponseError("the engine returned no indexer_topk although it was asked for")
        if self._topk is None or len(self._topk) == 0:
            self._topk, self._topk_start = rows, start
            return
        expected = self._topk_start + len(self._topk)
        if start > expected:
            raise MalformedResponseError(f"indexer_topk of turn {self.turns + 1} starts at row {start}; rows "
                                         f"{expected}..{start - 1} are missing")
        self._topk = np.concatenate([self._topk, rows[expected - start:]])

    async def call_tools(self, calls: Sequence[ToolCall]) -> list[str]:
        """Run a turn's calls (at once, each under its deadline) and return their outputs in order. A call cut by the
        trajectory's wall time (not its own deadline) ends the trajectory: truncated by wall_time."""
        limits = self.env.limits
        timeout = max(0.0, min(limits.tool_timeout_s, self.remaining_s))
        cut_by_wall = timeout < limits.tool_timeout_s
        allowed = calls[: limits.max_tool_calls_per_turn]
        results: list[ToolResult] = list(await asyncio.gather(*(
            call_tool(self.env.tools, call, timeout_s=timeout, max_output_chars=limits.max_tool_output_chars)
            for call in allowed)))
        results += [ToolResult(f"error: at most {limits.max_tool_calls_per_turn} tool calls run per turn", "error")
                    for _ in calls[len(allowed):]]
        self.tool_status.update(r.status for r in results)
        if cut_by_wall and any(r.status == "timeout" for r in results):
            self.truncate("wall_time")
        return [r.output for r in results]

    def observe(self, outputs: Sequence[str]) -> None:
        """Append the tool results as observation tokens (loss mask 0)."""
        last = self.sample.response_ids[-1] if self.sample.response_ids else None
        if self._observation_from is None:
            self._observation_from = len(self.sample.response_ids)
        self.sample.append_tokens(self.env.format.observation_ids(outputs, last), trainable=False)

    def truncate(self, by: TruncatedBy) -> None:
        """End the trajectory at its last model token, marked TRUNCATED by `by`."""
        self._drop_observation()
        self.done = True
        if not self.sample.response_ids:
            self.fail(f"the {by} limit ended the trajectory before its first turn")
            return None
        self.sample.status = SampleStatus.TRUNCATED
        self.sample.metadata["truncated_by"] = by
        return None

    def fail(self, error: str) -> None:
        """End the trajectory FAILED (not trained on) with `error`."""
        self.done = True
        self.sample.status = SampleStatus.FAILED
        self.sample.metadata["error"] = error
        logger.warning("sample %s: agent trajectory failed at turn %d: %s", self.sample.index, self.turns + 1, error)
        return None

    def _drop_observation(self) -> None:
        if self._observation_from is None:
            return
        n = self._observation_from
        s = self.sample
        del s.response_ids[n:], s.loss_mask[n:], s.rollout_logprobs[n:], s.weight_versions[n:]
        self._observation_from = None

    def finish(self) -> Sample:
        """The finished sample: status, top-k rows, response text and the metadata rewards and logs read."""
        s = self.sample
        if not self.done:
            s.status = SampleStatus.COMPLETED
            self.done = True
        if s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED):
            s.indexer_topk, s.indexer_topk_start = self._topk, self._topk_start
        s.response_text = self.env.tokenizer.decode(s.response_ids, skip_special_tokens=True)
        s.metadata.update({"final_response": self.last_text, "turns": self.turns,
                           "tool_calls": sum(self.tool_status.values()),
                           "tool_failures": sum(n for k, n in self.tool_status.items() if k != "ok"),
                           "agent_time_s": time.monotonic() - self.started})
        if s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED):
            s.validate()
        return s
