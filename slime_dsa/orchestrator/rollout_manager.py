"""Rollouts: prompts from the task mixture → n samples each through the engine client → rewards → groups.

One code path for every engine kind: all generation goes over HTTP in SGLang's protocol (`rollout.client`), one
batched /generate per group. A failed request costs its samples (the group's, or a requeued one's), an aborted
sample or a crashing reward function costs that sample: counted, never the step.
Two modes: `collect_step` fills one synchronous step; `produce` runs continuously for the asynchronous loop,
starting groups as a StalenessGate admits them and putting each finished group into the buffer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rollout.client import EngineClient, EngineError, indexer_topk_rows
from rollout.rewards.compute import RewardStats, compute_reward, reward_step_metrics
from rollout.rewards.registry import load_reward_fn
from slime_dsa.data.prompts import Prompt, Task, TaskMixture
from slime_dsa.data.sample import Sample, SampleStatus
from slime_dsa.orchestrator.buffer import SampleBuffer, StalenessGate
from slime_dsa.orchestrator.limiter import SampleLimiter

logger = logging.getLogger(__name__)

MAX_REQUEUES = 3  # an aborted sample is regenerated at most this many times (asynchronous loop, abort mode)


def _index_range(samples: list[Sample]) -> str:
    return str(samples[0].index) if len(samples) == 1 else f"{samples[0].index}-{samples[-1].index}"


def screen_group(group: list[Sample], dynamic_sampling: bool, counters: Counter) -> list[Sample] | None:
    """The group's trainable samples, or None when the group cannot be trained on; counts why in `counters`."""
    usable = [s for s in group if s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)]
    counters["failed_samples"] += len(group) - len(usable)
    if len(usable) < 2:
        counters["dropped_groups"] += 1
        return None
    if len({s.reward for s in usable}) == 1:
        counters["zero_std_groups"] += 1
        if dynamic_sampling:
            return None
    return usable


class RolloutManager:
    """Produces groups of rewarded samples into a SampleBuffer, at most `max_concurrency` in flight."""

    def __init__(self, client: EngineClient, tasks: list[Task], mixture: TaskMixture, tokenizer: Any, rollout: Any,
                 buffer: SampleBuffer | None = None, show_progress: bool = True, seed: int = 0) -> None:
        self.client, self.tasks, self.mixture, self.tokenizer, self.cfg = client, tasks, mixture, tokenizer, rollout
        self.seed = seed
        self.buffer = buffer or SampleBuffer()
        self.reward_fns = {t.name: load_reward_fn(t.reward_fn) for t in tasks}
        self.limiter = SampleLimiter(rollout.max_concurrency)
        self.show_progress = show_progress
        self.next_sample_index = 0
        self.next_group_id = 0
        self._progress: Progress | None = None
        self._progress_task = None
        self._reward_stats = {t.name: RewardStats() for t in tasks}
        self.produced_indices: list[int] = []  # every sample index `produce` started, in order
        self.in_flight: dict[int, list[int]] = {}  # group_id -> sample indices: started by `produce`, not buffered yet
        self._draws: dict[int, tuple[str, int]] = {}  # group_id -> its prompt's mixture draw (task, number)
        self._replay: list[dict[str, Any]] = []  # groups pending in the checkpoint resumed from, not restarted yet
        self.keep_share = 1.0  # dynamic sampling: the share of groups the last round kept, which sizes the next

    # -- state for exact resumption -----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The data position, and the groups `produce` started that the trainer has not taken yet (in flight or
        buffered): a resumed run regenerates those (same prompts, sample indices and seeds) before drawing new
        prompts, so across a save and resume no prompt is lost or used twice. Call it on the event loop."""
        pending = self._pending_groups()
        groups = [{"group_id": g, "first_index": indices[0], "num_samples": len(indices), "task": self._draws[g][0],
                   "draw": self._draws[g][1]} for g, indices in sorted(pending.items()) if g in self._draws]
        return {"mixture": self.mixture.state_dict(), "next_sample_index": self.next_sample_index,
                "next_group_id": self.next_group_id, "pending_groups": self._replay + groups,
                "keep_share": self.keep_share}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mixture.load_state_dict(state["mixture"])
        self.next_sample_index, self.next_group_id = state["next_sample_index"], state["next_group_id"]
        self._replay = list(state.get("pending_groups", []))
        self.keep_share = state.get("keep_share", 1.0)

    def _pending_groups(self) -> dict[int, list[int]]:
        """group_id -> sample indices of the groups `produce` started and the trainer has not taken; forgets the
        draws of the others."""
        buffered = {g[0].group_id: sorted(s.index for s in g) for g in self.buffer.peek() if g}
        pending = {**self.in_flight, **buffered}
        self._draws = {g: d for g, d in self._draws.items() if g in pending}
        return pending

    @property
    def num_pending_replays(self) -> int:
        """Groups of the checkpoint resumed from that `produce` has yet to restart."""
        return len(self._replay)

    # -- one sample, one group -----------------------------------------------------------------

    def sampling_params(self, greedy: bool = False) -> dict[str, Any]:
        params = {"max_new_tokens": self.cfg.max_response_length, "temperature": 0.0 if greedy else self.cfg.temperature,
                  "top_p": self.cfg.top_p, "top_k": self.cfg.top_k}
        if self.cfg.stop:
            params["stop"] = list(self.cfg.stop)
        return params

    def sample_seed(self, sample: Sample) -> int:
        """The sample's sampling seed: rollouts are reproducible (and resumption exact) whatever the batching or
        routing."""
        return (self.seed * 1_000_003 + sample.index) % 2**31

    async def generate_sample(self, sample: Sample, params: dict[str, Any], session_id: str | None) -> Sample:
        """Generate one response into `sample` and score it; failures mark the sample, never raise."""
        return (await self.generate_samples([sample], params, session_id))[0]

    async def generate_samples(self, samples: list[Sample], params: dict[str, Any],
                               session_id: str | None) -> list[Sample]:
        """Generate the responses of `samples` (one prompt's group) in ONE request, then score each; failures mark
        the samples, never raise. One HTTP call per group instead of per sample: the driver's and the server's
        per-request cost dominated rollout time for short responses."""
        cfg = self.cfg
        per_sample = [{**params, "sampling_seed": self.sample_seed(s)} for s in samples]
        options = dict(return_logprob=True, session_id=session_id, return_indexer_topk=cfg.return_indexer_topk,
                       timeout_s=cfg.request_timeout_s,
                       indexer_topk_start_len=0)  # the prompt rows too: replay is exact only with every row
        async with self.limiter.hold(len(samples)):
            try:
                if len(samples) == 1:
                    outs = [await self.client.generate(samples[0].prompt_ids, per_sample[0], **options)]
                else:
                    outs = await self.client.generate_batch([s.prompt_ids for s in samples], per_sample, **options)
                topks = [indexer_topk_rows(o["meta_info"]) if cfg.return_indexer_topk else (None, None) for o in outs]
            except (EngineError, asyncio.TimeoutError) as e:
                for sample in samples:
                    sample.status = SampleStatus.FAILED
                    sample.metadata["error"] = f"{type(e).__name__}: {e}"
                logger.warning("samples %s: generation failed: %s", _index_range(samples), e)
                return samples
        return list(await asyncio.gather(*(self._score(s, o, t) for s, o, t in zip(samples, outs, topks))))

    async def _score(self, sample: Sample, out: dict, topk: tuple[Any, int | None]) -> Sample:
        """Fill `sample` from its /generate response and compute its reward."""
        meta = out["meta_info"]
        ids = [int(tok) for _, tok, *_ in meta["output_token_logprobs"]]
        logprobs = [float(lp) for lp, *_ in meta["output_token_logprobs"]]
        versions = meta.get("output_token_versions") or [int(meta.get("weight_version") or 0)] * len(ids)
        sample.append_tokens(ids, logprobs, [int(v) for v in versions])
        sample.indexer_topk, sample.indexer_topk_start = topk
        sample.response_text = self.tokenizer.decode(ids, skip_special_tokens=True)
        finish = (meta.get("finish_reason") or {}).get("type")
        sample.status = {"length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}.get(finish, SampleStatus.COMPLETED)
        result = await compute_reward(self.reward_fns[sample.task], sample, timeout_s=self.cfg.reward_timeout_s,
                                      stats=self._reward_stats[sample.task])
        sample.reward = result.reward
        sample.metadata["reward_failed"] = result.failed
        sample.metadata.update({f"reward/{k}": v for k, v in result.metrics.items()})
        return sample

    def _new_samples(self, prompt: Prompt, n: int) -> list[Sample]:
        """n fresh samples of one new group, numbered in order."""
        group_id = self.next_group_id
        self.next_group_id += 1
        samples = []
        for _ in range(n):
            samples.append(prompt.to_sample(index=self.next_sample_index, group_id=group_id))
            self.next_sample_index += 1
        return samples

    async def generate_group(self, prompt: Prompt, n: int, greedy: bool = False) -> list[Sample]:
        samples = self._new_samples(prompt, n)
        params = self.sampling_params(greedy)
        # One session per group: the router keeps the n samples on one engine, which shares their prompt's cache.
        return await self._tracked(self.generate_samples(samples, params, f"group-{samples[0].group_id}"))

    # -- continuous production (asynchronous loop) -----------------------------------------------

    async def produce(self, gate: StalenessGate, requeue_aborted: bool) -> None:
        """Start a group whenever `gate` admits one and put it into the buffer when done; runs until cancelled.

        requeue_aborted: a sample the engine aborted (weights pushed with pause mode abort) is regenerated from
        scratch under the new weights, up to MAX_REQUEUES times; otherwise it stays aborted (not trained on).
        """
        running: set[asyncio.Task] = set()
        try:
            while True:
                await gate.acquire()
                if self._replay:  # first the groups a resumed checkpoint had pending, as they were
                    group = self._replay.pop(0)
                    draw = (group["task"], group["draw"])
                    prompt = self.mixture.replay(*draw)
                    samples = [prompt.to_sample(index=group["first_index"] + k, group_id=group["group_id"])
                               for k in range(group["num_samples"])]
                else:
                    prompt = next(self.mixture)
                    draw = self.mixture.last_draw
                    samples = self._new_samples(prompt, self.cfg.n_samples_per_prompt)
                self.produced_indices.extend(s.index for s in samples)
                self.in_flight[samples[0].group_id] = [s.index for s in samples]
                self._draws[samples[0].group_id] = draw
                if len(self._draws) > 2 * len(self.in_flight) + 2 * len(self.buffer) + 64:
                    self._pending_groups()  # forget the draws of groups the trainer took
                task = asyncio.create_task(self._produce_group(prompt, samples, requeue_aborted))
                running.add(task)
                task.add_done_callback(running.discard)
        finally:
            for task in list(running):
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _produce_group(self, prompt: Prompt, samples: list[Sample], requeue_aborted: bool) -> None:
        params = self.sampling_params()
        session = f"group-{samples[0].group_id}"

        async def requeued(done: Sample) -> Sample:
            """An aborted sample regenerated from scratch, up to MAX_REQUEUES times (when asked)."""
            for attempt in range(MAX_REQUEUES):
                if done.status != SampleStatus.ABORTED or not requeue_aborted:
                    return done
                sample = prompt.to_sample(index=done.index, group_id=done.group_id)
                sample.metadata["requeued"] = attempt + 1
                done = await self.generate_sample(sample, params, session)
            return done

        try:
            group = await self.generate_samples(samples, params, session)
            group = list(await asyncio.gather(*(requeued(s) for s in group)))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug here costs this group, never the run (the trainer waits on it)
            logger.exception("group %s failed", samples[0].group_id)
            for s in samples:
                s.status = SampleStatus.FAILED
                s.metadata["error"] = f"{type(e).__name__}: {e}"
            group = samples
        await self.buffer.put(group)
        del self.in_flight[samples[0].group_id]  # no await since the put: a group is never in both places

    async def _tracked(self, coro):
        """Await a coroutine that returns samples, advancing the progress bar by them."""
        result = await coro
        if self._progress is not None:
            self._progress.advance(self._progress_task, len(result))
        return result

    # -- one RL step's worth ---------------------------------------------------------------------

    async def collect_step(self) -> tuple[list[list[Sample]], dict[str, float]]:
        """Groups for one synchronous step (with DAPO dynamic sampling when enabled) and their rollout metrics."""
        cfg = self.cfg
        self.reset_reward_stats()
        start = time.perf_counter()
        kept: list[list[Sample]] = []
        counters: Counter[str] = Counter()
        all_samples: list[Sample] = []
        tries = 0
        with self._progress_bar(cfg.prompts_per_step * cfg.n_samples_per_prompt, "rollout"):
            while len(kept) < cfg.prompts_per_step and tries < (cfg.max_sampling_tries if cfg.dynamic_sampling else 1):
                tries += 1
                need = cfg.prompts_per_step - len(kept)
                n_prompts = self.round_size(need) if cfg.dynamic_sampling else need
                prompts = self.mixture.take(n_prompts)
                groups = await asyncio.gather(*(self.generate_group(p, cfg.n_samples_per_prompt) for p in prompts))
                usable_groups = 0
                for group in groups:
                    all_samples.extend(group)
                    usable = screen_group(group, cfg.dynamic_sampling, counters)
                    usable_groups += usable is not None
                    if usable is not None and len(kept) < cfg.prompts_per_step:
                        kept.append(usable)
                self.keep_share = usable_groups / len(groups)
        for group in kept:
            await self.buffer.put(group)
        metrics = self.rollout_metrics(all_samples, kept, counters, time.perf_counter() - start)
        metrics["rollout/sampling_rounds"] = tries
        return await self.buffer.get(len(kept)), metrics

    def round_size(self, need: int) -> int:
        """Prompts to draw in a dynamic-sampling round that still needs `need` groups: enough to fill it at the
        last round's keep share, times oversample_factor, at most max_oversample_factor times `need`."""
        cfg = self.cfg
        wanted = need * cfg.oversample_factor / max(self.keep_share, 1e-6)
        return max(need, min(round(wanted), round(need * cfg.max_oversample_factor)))

    def reset_reward_stats(self) -> None:
        """Start counting reward failures afresh (once per step)."""
        self._reward_stats = {t.name: RewardStats() for t in self.tasks}

    def rollout_metrics(self, samples: list[Sample], kept: list[list[Sample]], counters: Counter,
                        elapsed: float) -> dict[str, float]:
        """rollout/ and perf/ metrics of one step: `samples` all it generated, `kept` the groups it trains on."""
        scored = [s for s in samples if s.reward is not None]
        n = max(len(scored), 1)
        out_tokens = sum(s.response_length for s in samples)
        metrics = {
            "rollout/reward_mean": sum(s.reward for s in scored) / n,
            "rollout/response_length_mean": sum(s.response_length for s in scored) / n,
            "rollout/truncated_frac": sum(s.status == SampleStatus.TRUNCATED for s in samples) / max(len(samples), 1),
            "rollout/num_samples": len(samples),
            "rollout/num_groups_trained": len(kept),
            "rollout/zero_std_groups": counters["zero_std_groups"],
            "rollout/dropped_groups": counters["dropped_groups"],
            "rollout/failed_samples": counters["failed_samples"],
            **reward_step_metrics(self._reward_stats, self.cfg.reward_timeout_warn_share),
            "perf/rollout_time_s": elapsed,
            "perf/rollout_tok_s": out_tokens / max(elapsed, 1e-9),
        }
        for task in self.tasks:
            mine = [s.reward for s in scored if s.task == task.name]
            if mine and len(self.tasks) > 1:
                metrics[f"rollout/{task.name}/reward_mean"] = sum(mine) / len(mine)
        return metrics

    # -- evaluation -----------------------------------------------------------------------------

    async def evaluate(self, max_prompts: int | None = None) -> dict[str, float]:
        """Greedy responses on every task's held-out prompts: mean reward and pass@1 (reward >= 1 counts)."""
        self._reward_stats = {t.name: RewardStats() for t in self.tasks}
        metrics: dict[str, float] = {}
        rewards_all: list[float] = []
        prompts = [(task, p) for task in self.tasks if task.eval is not None for p in list(task.eval)[:max_prompts]]
        with self._progress_bar(len(prompts), "eval"):
            groups = await asyncio.gather(*(self.generate_group(p, 1, greedy=True) for _, p in prompts))
        by_task: dict[str, list[float]] = {}
        for (task, _), group in zip(prompts, groups):
            reward = float(group[0].reward or 0.0)
            by_task.setdefault(task.name, []).append(reward)
            rewards_all.append(reward)
        for name, rewards in by_task.items():
            metrics[f"eval/{name}/reward_mean"] = sum(rewards) / len(rewards)
            metrics[f"eval/{name}/pass@1"] = sum(r >= 1.0 for r in rewards) / len(rewards)
        if rewards_all:
            metrics["eval/reward_mean"] = sum(rewards_all) / len(rewards_all)
            metrics["eval/pass@1"] = sum(r >= 1.0 for r in rewards_all) / len(rewards_all)
        return metrics

    @contextmanager
    def _progress_bar(self, total: int, label: str) -> Iterator[None]:
        """A rich progress bar over samples while `label` runs (transient: it leaves no lines behind)."""
        if not self.show_progress:
            yield
            return
        self._progress = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                  transient=True)
        self._progress_task = self._progress.add_task(label, total=total)
        try:
            with self._progress:
                yield
        finally:
            self._progress = None
