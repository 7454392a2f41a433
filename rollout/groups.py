"""Groups of rewarded samples: the n samples of one prompt in ONE /generate, then a reward for each.

A task with an agent (data.tasks.<i>.agent) plays n multi-turn trajectories instead (rollout/agents), concurrently,
each its own sequence of /generate calls in the group's session; GRPO then compares the n trajectories.

One HTTP call per group instead of per sample: the driver's and the server's per-request cost dominated rollout
time for short responses. Each sample carries its own sampling seed, so rollouts are reproducible (and resumption
exact) whatever the batching or routing. To our embedded engines the call carries the prompt once, with `n` and the
first seed (the server gives sample j seed sampling_seed + j; the group's seeds are consecutive); to SGLang, which
gives n samples one seed, it is a batch of one prompt per sample, each with its seed. Both give the same samples.
With rollout.coalesce_calls the client sends the group calls made at once to one embedded engine in one batch body
(rollout/coalesce.py); each group still holds its limiter places and is timed (`clock`) from its call to its answer,
which then comes with the body's slowest group.
A failed request costs its group's samples, an aborted sample or a crashing reward function costs that sample:
marked on the sample and counted, never raised.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Protocol

from rollout.agents.runtime import AgentRuntime
from rollout.client import EngineError, indexer_topk_rows, n_sample_params
from rollout.engine.defaults import DEFAULT_MAX_RUNNING_REQUESTS
from rollout.limiter import SampleLimiter
from rollout.rewards.compute import RewardStats, compute_reward, reward_step_metrics
from rollout.rewards.registry import load_reward_fn
from rollout.timing import RolloutClock
from slime_dsa.data.sample import Sample, SampleStatus

if TYPE_CHECKING:
    from slime_dsa.config.schema import RolloutSection
    from rollout.teachers.pool import TeacherPool
    from slime_dsa.data.prompts import Prompt, Task

logger = logging.getLogger(__name__)


class GenerateClient(Protocol):
    """What group generation needs of a client: EngineClient (over HTTP), InProcessClient (no server)."""

    async def generate(self, input_ids: Sequence[int], sampling_params: dict | None = None, *,
                       return_logprob: bool = True, session_id: str | None = None, return_indexer_topk: bool = False,
                       indexer_topk_start_len: int = -1, timeout_s: float | None = None) -> dict | list[dict]:
        """One response dict; a list of n when sampling_params has n > 1."""

    async def generate_batch(self, prompts: Sequence[Sequence[int]], sampling_params: Sequence[dict], *,
                             return_logprob: bool = True, session_id: str | None = None,
                             return_indexer_topk: bool = False, indexer_topk_start_len: int = -1,
                             timeout_s: float | None = None) -> list[dict]: ...


@dataclass
class SampleNumbering:
    """Run-unique sample indices and group ids, handed out in order; a sample's seed derives from its index."""

    next_sample_index: int = 0
    next_group_id: int = 0

    def new_group(self, prompt: Prompt, n: int) -> list[Sample]:
        """n fresh samples of `prompt` under a new group id."""
        group_id = self.next_group_id
        self.next_group_id += 1
        first = self.next_sample_index
        self.next_sample_index += n
        return [prompt.to_sample(index=first + k, group_id=group_id) for k in range(n)]


_FINISH_STATUS = {"length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}  # else completed
_LOGPROB, _TOKEN = itemgetter(0), itemgetter(1)


def answer_tokens(meta: dict) -> tuple[list[int], list[float], list[int]]:
    """(token ids, log-probs, weight versions) of the output tokens of one /generate answer's meta_info."""
    entries = meta["output_token_logprobs"]  # [logprob, token id, text] per token
    ids = list(map(int, map(_TOKEN, entries)))
    versions = meta.get("output_token_versions") or [int(meta.get("weight_version") or 0)] * len(ids)
    return ids, list(map(float, map(_LOGPROB, entries))), list(map(int, versions))


def text_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)` as a function of the ids.

    A transformers fast tokenizer whose decode only calls its Rust tokenizer (no clean-up of spaces, no override) is
    decoded by the Rust tokenizer directly: transformers' wrapper checks every id in Python first."""
    if _plain_fast_tokenizer(tokenizer):
        return lambda ids: tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _plain_fast_tokenizer(tokenizer: Any) -> bool:
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase  # noqa: PLC0415
        from transformers.tokenization_utils_tokenizers import TokenizersBackend  # noqa: PLC0415
    except ImportError:
        return False
    cls = type(tokenizer)
    return (isinstance(tokenizer, TokenizersBackend) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is TokenizersBackend._decode and tokenizer.clean_up_tokenization_spaces is False)


def _index_range(samples: list[Sample]) -> str:
    return str(samples[0].index) if len(samples) == 1 else f"{samples[0].index}-{samples[-1].index}"


class GroupRollout:
    """Generates and scores groups through one client, at most rollout.max_concurrency samples in flight.

    indexer_topk: ask for the DSA top-k of every row (index replay); default rollout.return_indexer_topk.
    teachers: score each sampled (not greedy) group with its domain's teacher.
    """

    def __init__(self, client: GenerateClient, tasks: list[Task], tokenizer: Any, rollout: RolloutSection,
                 seed: int = 0, limiter: SampleLimiter | None = None, indexer_topk: bool | None = None,
                 teachers: TeacherPool | None = None) -> None:
        self.client, self.tasks, self.tokenizer, self.cfg, self.seed = client, tasks, tokenizer, rollout, seed
        self.decode = text_decoder(tokenizer)
        self.teachers = teachers
        # rollout.max_concurrency null: a run passes its resolved limiter; alone (SFT's evaluation), one step's
        # samples and at least what one engine runs at once.
        self.limiter = limiter or SampleLimiter(
            rollout.max_concurrency or max(rollout.step_samples(), DEFAULT_MAX_RUNNING_REQUESTS))
        self.indexer_topk = rollout.return_indexer_topk if indexer_topk is None else indexer_topk
        self.n_sample_calls = rollout.engine == "embedded"  # a group's call carries its prompt once (module docstring)
        self.reward_fns = {t.name: load_reward_fn(t.reward_fn) for t in tasks}
        self.inline_rewards = {name: fn.isolation == "inline" and not fn.is_async
                               for name, fn in self.reward_fns.items()}
        self.reward_stats = {t.name: RewardStats() for t in tasks}
        self.clock = RolloutClock()  # the current phase's timings (StepCollector starts it)
        self.agents = {t.name: AgentRuntime.build(t.agent, tokenizer, rollout.max_response_length)
                       for t in tasks if getattr(t, "agent", None) is not None}

    def reset_reward_stats(self) -> None:
        """Count reward calls and failures afresh."""
        self.reward_stats = {t.name: RewardStats() for t in self.tasks}

    def reward_metrics(self) -> dict[str, float]:
        """rollout/reward_failures and rollout/reward_timeouts since the last reset (a WARNING when too many timed
        out)."""
        return reward_step_metrics(self.reward_stats, self.cfg.reward_timeout_warn_share)

    def sampling_params(self, greedy: bool = False) -> dict[str, Any]:
        cfg = self.cfg
        params = {"max_new_tokens": cfg.max_response_length, "temperature": 0.0 if greedy else cfg.temperature,
                  "top_p": cfg.top_p, "top_k": cfg.top_k}
        if cfg.stop:
            params["stop"] = list(cfg.stop)
        return params

    def sample_seed(self, sample: Sample) -> int:
        return (self.seed * 1_000_003 + sample.index) % 2**31

    async def generate_group(self, samples: list[Sample], greedy: bool = False) -> list[Sample]:
        """Generate and score `samples` (one prompt's, numbered) in one request, or as agent trajectories when their
        task has an agent; failures mark the samples."""
        agent = self.agents.get(samples[0].task)
        if agent is not None:
            return await self._generate_trajectories(samples, agent, greedy)
        params = self.sampling_params(greedy)
        # One session per group: the router keeps the group on one engine, which shares its prompt's cache.
        options = dict(return_logprob=True, session_id=f"group-{samples[0].group_id}",
                       return_indexer_topk=self.indexer_topk, timeout_s=self.cfg.request_timeout_s,
                       indexer_topk_start_len=0)  # the prompt rows too: replay is exact only with every row
        async with self.limiter.hold(len(samples)):
            try:
                sent_at = self.clock.sent()
                outs = await self._call(samples, params, options)
                self.clock.answered(sent_at, outs[0]["meta_info"].get("e2e_latency") if outs else None)
                topks = [indexer_topk_rows(o["meta_info"]) if self.indexer_topk else (None, None) for o in outs]
            except (EngineError, asyncio.TimeoutError) as e:
                for sample in samples:
                    sample.status = SampleStatus.FAILED
                    sample.metadata["error"] = f"{type(e).__name__}: {e}"
                logger.warning("samples %s: generation failed: %s", _index_range(samples), e)
                return samples
        samples = samples[: len(outs)]
        start = time.perf_counter()
        for sample, out, topk in zip(samples, outs, topks):
            self._fill(sample, out["meta_info"], topk)
        self.clock.assemble_s += time.perf_counter() - start
        samples = await self._reward_all(samples)
        if self.teachers is not None and not greedy:
            await self.teachers.score_group(samples)
        return samples

    async def _call(self, samples: list[Sample], params: dict[str, Any], options: dict[str, Any]) -> list[dict]:
        """The group's /generate, one response per sample in order: the prompt once with n samples (embedded engines,
        consecutive seeds), else one prompt per sample with its own seed."""
        seeds = [self.sample_seed(s) for s in samples]
        first = samples[0].prompt_ids
        if len(samples) == 1:
            return [await self.client.generate(first, {**params, "sampling_seed": seeds[0]}, **options)]
        compact = n_sample_params(params, seeds) if self.n_sample_calls else None
        if compact is not None and all(s.prompt_ids == first for s in samples):
            return await self.client.generate(first, compact, **options)
        # seeds that wrap at 2**31 inside the group are not consecutive: this form, about once in 10**8 groups
        return await self.client.generate_batch([s.prompt_ids for s in samples],
                                                [{**params, "sampling_seed": seed} for seed in seeds], **options)

    async def _generate_trajectories(self, samples: list[Sample], agent: AgentRuntime, greedy: bool) -> list[Sample]:
        """Play and score one trajectory per sample, all at once, in the group's session."""
        params = self.sampling_params(greedy)
        del params["max_new_tokens"]  # per turn, from the trajectory's budget
        async with self.limiter.hold(len(samples)):
            done = await asyncio.gather(*(
                agent.run(s, self.client, params, seed=self.sample_seed(s), session_id=f"group-{s.group_id}",
                          indexer_topk=self.indexer_topk, request_timeout_s=self.cfg.request_timeout_s)
                for s in samples))
        return await self._reward_all(list(done))

    def _fill(self, sample: Sample, meta: dict, topk: tuple[Any, int | None]) -> None:
        """Fill `sample` from its /generate answer's meta_info: tokens, log-probs, versions, replay rows, text."""
        ids, logprobs, versions = answer_tokens(meta)
        sample.append_tokens(ids, logprobs, versions)
        sample.indexer_topk, sample.indexer_topk_start = topk
        sample.response_text = self.decode(ids)
        reason = meta.get("finish_reason") or {}
        sample.status = _FINISH_STATUS.get(reason.get("type"), SampleStatus.COMPLETED)
        if sample.status == SampleStatus.ABORTED and reason.get("message"):
            sample.metadata["error"] = str(reason["message"])  # e.g. the engine's error: why the sample is not trained

    async def _reward_all(self, samples: list[Sample]) -> list[Sample]:
        """Score `samples`: in turn when each one's reward function runs inline (each call ends before the next
        starts either way, and a task per sample cost more than the call), else concurrently."""
        if all(self.inline_rewards[s.task] for s in samples):
            return [await self._reward(s) for s in samples]
        return list(await asyncio.gather(*(self._reward(s) for s in samples)))

    async def _reward(self, sample: Sample) -> Sample:
        """Score a generated sample (a failed one is left unscored: it is never trained on)."""
        if sample.status == SampleStatus.FAILED:
            return sample
        result = await compute_reward(self.reward_fns[sample.task], sample, timeout_s=self.cfg.reward_timeout_s)
        # Counted once it ends: the asynchronous loop resets the counters while calls run, and a call counted into
        # the counters it started under was lost with them.
        self.reward_stats[sample.task].add(result)
        self.clock.reward_s += result.elapsed_s
        sample.reward = result.reward
        sample.metadata["reward_failed"] = result.failed
        sample.metadata.update({f"reward/{k}": v for k, v in result.metrics.items()})
        return sample
