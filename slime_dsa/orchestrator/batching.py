"""Samples → the trainer's packed TrainBatch: advantages, loss masks and per-token rollout log-probs; and what a
critic's per-token advantages read besides the batch (its values, which trajectories were cut by a limit)."""

from __future__ import annotations

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
    out = torch.full((n_full, sum(s.total_length for s in samples), k), REPLAY_COMPUTE, dtype=torch.long)
    start = 0
    for s in samples:
        if s.indexer_topk is not None and len(s.indexer_topk):
            rows = start + s.topk_first_row
            out[:, rows : rows + len(s.indexer_topk)] = torch.tensor(s.indexer_topk, dtype=torch.long).permute(1, 0, 2)
        start += s.total_length
    return out


def build_train_batch(samples: list[Sample], advantages: torch.Tensor, index_replay: bool = False) -> TrainBatch:
    """Pack prompt+response of every sample; only response tokens the policy generated are trained on.

    advantages: (N,) one per sample, broadcast to its tokens (a critic's per-token advantages replace them later).

    The engines' top-k (when samples carry it) becomes `replay_topk` with index_replay, else `rollout_topk`
    (kept to measure the rollout/training selection mismatch; a trainer whose DSAOptions.index_replay is on
    replays it all the same, so callers that do not pass index_replay still get replay from the recipe).
    """
    ids, mask, rollout_logp, adv, seqlens = [], [], [], [], []
    for sample, a in zip(samples, advantages.tolist()):
        n_prompt, n_resp = len(sample.prompt_ids), len(sample.response_ids)
        ids.extend(sample.tokens)
        mask.extend([0.0] * n_prompt + [float(m) for m in sample.loss_mask])
        rollout_logp.extend([0.0] * n_prompt + list(sample.rollout_logprobs))
        adv.extend([a] * (n_prompt + n_resp))
        seqlens.append(n_prompt + n_resp)
    topk = engine_topk_rows(samples)
    return TrainBatch(
        input_ids=torch.tensor(ids, dtype=torch.long), seqlens=seqlens,
        loss_mask=torch.tensor(mask, dtype=torch.float32), rollout_logprobs=torch.tensor(rollout_logp, dtype=torch.float32),
        advantages=torch.tensor(adv, dtype=torch.float32),
        replay_topk=topk if index_replay else None, rollout_topk=None if index_replay else topk,
        prompt_lens=[len(s.prompt_ids) for s in samples],
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
