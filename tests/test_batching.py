"""build_train_batch against a per-sample reference construction: ragged samples, tool tokens, index replay rows,
sample-level advantages in float32 and float64, and what a critic's token-level advantages read of the batch."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from slime_dsa.data.sample import Sample, SampleStatus
from slime_dsa.models.glm_moe_dsa import REPLAY_COMPUTE
from slime_dsa.orchestrator.batching import build_train_batch, critic_advantage_inputs, engine_topk_rows

N_FULL, K = 2, 5


def reference_batch(samples: list[Sample], advantages: torch.Tensor) -> dict[str, torch.Tensor]:
    """The packed tensors built one sample and one token at a time."""
    ids, mask, logp, adv = [], [], [], []
    for s, a in zip(samples, advantages.tolist()):
        p = len(s.prompt_ids)
        ids.extend(s.prompt_ids + s.response_ids)
        mask.extend([0.0] * p + [float(m) for m in s.loss_mask])
        logp.extend([0.0] * p + list(s.rollout_logprobs))
        adv.extend([a] * s.total_length)
    return {"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(mask, dtype=torch.float32),
            "rollout_logprobs": torch.tensor(logp, dtype=torch.float32),
            "advantages": torch.tensor(adv, dtype=torch.float32)}


def reference_topk(samples: list[Sample]) -> torch.Tensor:
    """REPLAY_COMPUTE everywhere, then each sample's rows copied in."""
    out = torch.full((N_FULL, sum(s.total_length for s in samples), K), REPLAY_COMPUTE, dtype=torch.long)
    start = 0
    for s in samples:
        if s.indexer_topk is not None and len(s.indexer_topk):
            rows = start + s.topk_first_row
            out[:, rows : rows + len(s.indexer_topk)] = torch.tensor(s.indexer_topk, dtype=torch.long).permute(1, 0, 2)
        start += s.total_length
    return out


def ragged_samples(rng: random.Random, topk_starts: list[str]) -> list[Sample]:
    """One sample per entry of topk_starts (none / prompt: from row 0 / output: start None / empty), varied lengths,
    some with tool tokens (loss_mask 0) inside the response."""
    samples = []
    for i, kind in enumerate(topk_starts):
        prompt = [rng.randrange(3, 400) for _ in range(rng.randint(1, 12))]
        s = Sample(prompt_ids=prompt, index=i, group_id=i // 2, reward=float(rng.random() < 0.5),
                   status=SampleStatus.COMPLETED)
        for turn in range(rng.randint(1, 3)):
            n = rng.randint(1, 9)
            ids, logprobs = [rng.randrange(3, 400) for _ in range(n)], [-rng.random() * 5 for _ in range(n)]
            s.append_tokens(ids, logprobs, [turn] * n)
            if rng.random() < 0.5:
                s.append_tokens([rng.randrange(3, 400) for _ in range(rng.randint(1, 4))], trainable=False)
        rows = s.total_length - 1
        if kind == "prompt":
            s.indexer_topk, s.indexer_topk_start = np.random.default_rng(i).integers(-1, rows, (rows, N_FULL, K)), 0
        elif kind == "output":
            n_out = s.response_length
            s.indexer_topk = np.random.default_rng(i).integers(-1, rows, (n_out, N_FULL, K)).astype(np.int32)
        elif kind == "empty":
            s.indexer_topk, s.indexer_topk_start = np.zeros((0, N_FULL, K), np.int32), s.total_length - 1
        samples.append(s.validate())
    return samples


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_batch_equals_the_per_sample_construction(seed: int, dtype: torch.dtype) -> None:
    rng = random.Random(seed)
    samples = ragged_samples(rng, [rng.choice(["none", "prompt", "output", "empty"]) for _ in range(9)])
    advantages = torch.tensor([rng.gauss(0, 1) for _ in samples], dtype=dtype)
    for replay in (False, True):
        batch = build_train_batch(samples, advantages, index_replay=replay)
        for name, expected in reference_batch(samples, advantages).items():
            got = getattr(batch, name)
            assert got.dtype == expected.dtype and torch.equal(got, expected), name
        assert batch.seqlens == [s.total_length for s in samples]
        assert batch.prompt_lens == [len(s.prompt_ids) for s in samples]
        topk = batch.replay_topk if replay else batch.rollout_topk
        assert (batch.rollout_topk if replay else batch.replay_topk) is None
        if all(s.indexer_topk is None for s in samples):
            assert topk is None
        else:
            assert topk.dtype == torch.long and topk.is_contiguous() and torch.equal(topk, reference_topk(samples))


def test_prompts_shared_by_a_group_pack_as_each_samples_own() -> None:
    """Consecutive samples with equal prompts (copies or one list, as a group's n samples) are converted once;
    prompts that differ next to them (same length, a prefix, longer) still pack as their own."""
    rng = random.Random(3)
    base = [rng.randrange(3, 400) for _ in range(7)]
    prompts = [base, list(base), base, base[:5], list(base[:5]), [*base[:6], 401], base + [5], list(base)]
    samples = []
    for i, prompt in enumerate(prompts):
        s = Sample(prompt_ids=prompt, index=i, group_id=0, reward=0.0, status=SampleStatus.COMPLETED)
        n = rng.randint(0, 4)
        s.append_tokens([rng.randrange(3, 400) for _ in range(n)], [-1.0] * n, [0] * n)
        samples.append(s)
    advantages = torch.zeros(len(samples))
    batch = build_train_batch(samples, advantages)
    assert torch.equal(batch.input_ids, reference_batch(samples, advantages)["input_ids"])


def test_index_replay_rows_of_every_kind_in_one_batch() -> None:
    samples = ragged_samples(random.Random(5), ["prompt", "none", "output", "empty", "prompt"])
    assert torch.equal(engine_topk_rows(samples), reference_topk(samples))
    assert engine_topk_rows([s for s in samples if s.indexer_topk is None]) is None


def test_a_critics_token_level_inputs_read_the_packed_batch() -> None:
    """Token-level advantages start from zeros per sample; the critic's inputs index the batch's tokens."""
    samples = ragged_samples(random.Random(3), ["none"] * 6)
    batch = build_train_batch(samples, torch.zeros(len(samples)))
    assert torch.equal(batch.advantages, torch.zeros(batch.num_tokens))
    inputs = critic_advantage_inputs(samples, batch, torch.zeros(batch.num_tokens), torch.zeros(len(samples)))
    expected_index = [i for i, s in enumerate(samples) for _ in range(s.total_length)]
    assert inputs.sample_index.tolist() == expected_index
    assert torch.equal(inputs.loss_mask, reference_batch(samples, torch.zeros(len(samples)))["loss_mask"])


def test_an_empty_step_packs_to_empty_tensors() -> None:
    batch = build_train_batch([], torch.zeros(0))
    assert batch.num_tokens == 0 and batch.seqlens == [] and batch.rollout_topk is None
    assert batch.loss_mask.dtype == torch.float32 and batch.input_ids.dtype == torch.long


def test_a_per_token_list_of_the_wrong_length_is_named() -> None:
    s = Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5], loss_mask=[1, 1], rollout_logprobs=[-1.0] * 3, index=7)
    with pytest.raises(ValueError, match="sample 7: loss_mask has 2 entries, response_ids has 3"):
        build_train_batch([s], torch.zeros(1))
