"""Samples → the trainer's packed TrainBatch: advantages, loss masks and per-token rollout log-probs; and what a
critic's per-token advantages read besides the batch (its values, which trajectories were cut by a limit)."""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from slime_dsa.algorithms.is_correction import logprob_agreement_sums
from slime_dsa.algorithms.specs import AdvantageInputs, Algorithm
from slime_dsa.data.sample import Sample, SampleStatus
from trainers.base import TrainBatch


def _rewards_and_groups(samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    rewards = torch.tensor([float(s.reward or 0.0) for s in samples], dtype=torch.float32)
    group_ids = torch.tensor([s.group_id if s.group_id is not None else s.index for s in samples])
    return rewards, group_ids


def sample_advantages(samples: list[Sample], algorithm: Algorithm) -> torch.Tensor:
    """One advantage per sample, from the algorithm's advantage function on the samples' rewards and groups."""
    rewards, group_ids = _rewards_and_groups(samples)
    return algorithm.advantages(AdvantageInputs(rewards=rewards, group_ids=group_ids))


def cut_by_limit(sample: Sample) -> bool:
    """An agent loop stopped the trajectory at one of its limits (turns, tokens, wall time): the episode goes on."""
    return sample.status == SampleStatus.TRUNCATED and bool(sample.metadata.get("truncated_by"))


def critic_advantage_inputs(samples: list[Sample], batch: TrainBatch, values: torch.Tensor,
                            final_values: torch.Tensor) -> AdvantageInputs:
    """What a critic's per-token advantages read: rewards and groups, the batch's loss mask and sample index, the
    critic's values (T,) and final values (N,) (TrainerGroup.compute_values), and which trajectories an agent loop
    cut by one of its limits (status truncated with metadata["truncated_by"]).

    A single response cut at rollout.max_response_length is not among them: its reward function scored it, so its
    episode ended there."""
    rewards, group_ids = _rewards_and_groups(samples)
    sample_index = torch.repeat_interleave(torch.arange(len(batch.seqlens)), torch.tensor(batch.seqlens))
    truncated = torch.tensor([cut_by_limit(s) for s in samples], dtype=torch.bool)
    return AdvantageInputs(rewards=rewards, group_ids=group_ids, loss_mask=batch.loss_mask, sample_index=sample_index,
                           values=values, final_values=final_values, truncated=truncated)


def engine_topk_rows(samples: list[Sample]) -> torch.Tensor | None:
    """The engines' top-k as (n_full_layers, T, K) over the packed samples, or None when no sample carries it.

    A sample's rows indexer_topk_start .. P+R-2 (row p produced token p+1, rollout/engine/engine.py) are filled in;
    every other row is REPLAY_COMPUTE (the trainer selects there itself). Replay is exact when the engine returned
    the prompt rows too (indexer_topk_start_len 0: it leaves out only rows below index_topk, where every top-k takes
    all causal keys); with output rows only (start P-1) the trainer's own selection of the prompt rows must agree
    with the engine's, which near-tied index scores break (tests/test_index_replay.py).
    """
    from slime_dsa.models.glm_moe_dsa import REPLAY_COMPUTE  # noqa: PLC0415

    shapes = {s.indexer_topk.shape[1:] for s in samples if s.indexer_topk is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"samples' indexer_topk disagree on (n_full_layers, index_topk): {sorted(shapes)}")
    n_full, k = shapes.pop()
    # Only the rows no sample covers are filled: the covered ones (nearly all) are written once, cast on the way.
    out = np.empty((n_full, sum(s.total_length for s in samples), k), dtype=np.int64)
    start = 0
    for s in samples:
        covered = len(s.indexer_topk) if s.indexer_topk is not None else 0
        first = start + s.topk_first_row if covered else start + s.total_length
        out[:, start:first] = REPLAY_COMPUTE
        if covered:
            out[:, first : first + covered] = s.indexer_topk.transpose(1, 0, 2)
            out[:, first + covered : start + s.total_length] = REPLAY_COMPUTE
        start += s.total_length
    return torch.from_numpy(out)


def _response_rows(prompt_lens: list[int], response_lens: list[int]) -> np.ndarray:
    """(T,) bool over the packed samples: True on response tokens."""
    lengths = np.empty(2 * len(prompt_lens), dtype=np.int64)
    lengths[0::2], lengths[1::2] = prompt_lens, response_lens
    return np.repeat(np.tile(np.array([False, True]), len(prompt_lens)), lengths)


def _per_response_token(samples: list[Sample], name: str, n_tokens: int) -> np.ndarray:
    """The samples' per-response-token list `name` concatenated, as float32; ValueError on a length mismatch."""
    for s in samples:
        if len(getattr(s, name)) != len(s.response_ids):
            raise ValueError(f"sample {s.index}: {name} has {len(getattr(s, name))} entries, response_ids has "
                             f"{len(s.response_ids)}")
    return np.fromiter(chain.from_iterable(getattr(s, name) for s in samples), dtype=np.float32, count=n_tokens)


def _prompt_arrays(samples: list[Sample]) -> list[np.ndarray]:
    """Each sample's prompt as an int64 array; a prompt equal to the sample before's (a group's n samples) is that
    array again, so most of a batch's tokens are not converted from Python ints one by one."""
    arrays, last, last_array = [], None, None
    for s in samples:
        prompt = s.prompt_ids
        if not (prompt is last or (type(prompt) is list and type(last) is list and prompt == last)):
            last, last_array = prompt, np.asarray(prompt, dtype=np.int64)
        arrays.append(last_array)
    return arrays


def build_train_batch(samples: list[Sample], advantages: torch.Tensor, index_replay: bool = False) -> TrainBatch:
    """Pack prompt+response of every sample; only response tokens the policy generated are trained on.

    advantages: (N,) one per sample, broadcast to its tokens (a critic's per-token advantages replace them later).

    The engines' top-k (when samples carry it) becomes `replay_topk` with index_replay, else `rollout_topk`
    (kept to measure the rollout/training selection mismatch; a trainer whose DSAOptions.index_replay is on
    replays it all the same, so callers that do not pass index_replay still get replay from the recipe).
    """
    prompt_lens = [len(s.prompt_ids) for s in samples]
    response_lens = [len(s.response_ids) for s in samples]
    seqlens = [p + r for p, r in zip(prompt_lens, response_lens)]
    total = sum(seqlens)
    response = _response_rows(prompt_lens, response_lens)
    input_ids = np.empty(total, dtype=np.int64)
    # One conversion per field over flat lists: per-sample tensors cost more than the packing itself.
    input_ids[response] = np.fromiter(chain.from_iterable(s.response_ids for s in samples), dtype=np.int64,
                                      count=sum(response_lens))
    input_ids[~response] = np.concatenate(_prompt_arrays(samples)) if samples else []
    loss_mask, rollout_logp = np.zeros(total, dtype=np.float32), np.zeros(total, dtype=np.float32)
    loss_mask[response] = _per_response_token(samples, "loss_mask", sum(response_lens))
    rollout_logp[response] = _per_response_token(samples, "rollout_logprobs", sum(response_lens))
    topk = engine_topk_rows(samples)
    return TrainBatch(
        input_ids=torch.from_numpy(input_ids), seqlens=seqlens,
        loss_mask=torch.from_numpy(loss_mask), rollout_logprobs=torch.from_numpy(rollout_logp),
        # numpy's repeat: torch's repeat_interleave on a CPU took ~4 ms over a 64 x 16 batch's 107,000 tokens
        advantages=torch.from_numpy(np.repeat(advantages.detach().to("cpu", torch.float32).numpy(), seqlens)),
        replay_topk=topk if index_replay else None, rollout_topk=None if index_replay else topk,
        prompt_lens=prompt_lens,
    )


def logprob_agreement(batch: TrainBatch) -> dict[str, float]:
    """How π_old (the trainer's forward) and π_roll (the engine's) agree over the batch's trained tokens: the mean
    and max |Δlogp| (a silent weight-sync error shows here) and the fraction of tokens where they are equal bit for
    bit. Keys as the trainers report them for the first step's forward."""
    if batch.old_logprobs is None:
        return {"sync_logprob_abs_diff": float("nan")}
    sums = {k: float(v) for k, v in
            logprob_agreement_sums(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask).items()}
    tokens = sums["sync_logprob_abs_diff/den"]
    if not tokens:
        return {"sync_logprob_abs_diff": 0.0, "sync_logprob_abs_diff_max": 0.0, "sync_logprob_exact": float("nan")}
    return {"sync_logprob_abs_diff": sums["sync_logprob_abs_diff/num"] / tokens,
            "sync_logprob_abs_diff_max": sums["sync_logprob_abs_diff_max"],
            "sync_logprob_exact": sums["sync_logprob_exact/num"] / tokens}
