"""The trainer's kernel warm-up (trainers/warmup.py, TrainerRank.warm_up): which micro-batches it runs, that it
leaves a run's results as they were, and on the GPU that a step after it compiles no kernel."""

from __future__ import annotations

import random

import pytest
import torch

from tests.test_rank_step import _checkpoint
from tests.triton_cache import compiled_kernels, new_compiles
from trainers.base import TrainBatch
from trainers.warmup import PROMPT_TOKENS, warmup_batches, warmup_lengths


def test_warmup_lengths_cover_each_attention_path_a_run_can_take():
    assert warmup_lengths(416, 256) == [48, 416]  # within index_topk, and past it
    assert warmup_lengths(200, 256) == [48]  # never past index_topk: one path
    assert warmup_lengths(4096, 256) == [48, 512, 4096]  # past 4x index_topk too (no short ranges)
    assert warmup_lengths(30, 256) == [30]
    assert warmup_lengths(10, 256) == []  # shorter than the shared prompt: nothing to warm


def _packed_rows(mb: TrainBatch) -> int:
    return sum(mb.seqlens) - PROMPT_TOKENS * (len(mb.seqlens) - 1)  # shared-prompt packing computes the prompt once


def test_warmup_batches_have_both_parities_share_a_prompt_and_train_only_responses():
    batches = warmup_batches(416, 256, vocab_size=97, token_budget=4096)
    assert len(batches) == 4
    for short_or_long in (batches[:2], batches[2:]):
        assert {_packed_rows(mb) % 16 == 0 for mb in short_or_long} == {True, False}
        assert {mb.num_tokens % 2 for mb in short_or_long} == {0, 1}
    for mb in batches:
        rows = torch.tensor(mb.seqlens).cumsum(0) - torch.tensor(mb.seqlens)
        prompts = [mb.input_ids[start : start + PROMPT_TOKENS] for start in rows.tolist()]
        assert all(torch.equal(p, prompts[0]) for p in prompts) and mb.prompt_lens == [PROMPT_TOKENS] * len(mb.seqlens)
        assert float(mb.loss_mask.sum()) == sum(n - PROMPT_TOKENS for n in mb.seqlens)
        assert int(mb.input_ids.max()) < 97 and mb.advantages.abs().sum() > 0
    assert max(b.seqlens[0] for b in batches) == 416


def test_a_warmup_pair_over_the_token_budget_is_split():
    batches = warmup_batches(416, 256, vocab_size=97, token_budget=600)
    assert [mb.seqlens for mb in batches] == [[48, 48], [48, 47], [416], [415]]


def _worker(checkpoint, **options):
    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from trainers.base import DSAOptions, OptimizerConfig, policy_config  # noqa: PLC0415
    from trainers.fsdp.worker import FSDPWorker  # noqa: PLC0415
    from trainers.process_group import free_port  # noqa: PLC0415

    dsa = DSAOptions(indexer_loss_coef=options.pop("indexer_loss_coef", 0.0))
    config = policy_config(str(checkpoint), PPOLoss(), OptimizerConfig(learning_rate=1e-3), dsa=dsa, seed=0, **options)
    return FSDPWorker(0, 1, "127.0.0.1", free_port(), config)


def _train_twice(worker, batch: TrainBatch) -> tuple[list, dict[str, torch.Tensor]]:
    results = []
    for _ in range(2):
        results.append(worker.train_batches([batch], [(float(batch.loss_mask.sum()), len(batch.seqlens))],
                                            recompute_old_logprobs=True))
    weights = {k: v.detach().cpu().clone() for k, v in worker.policy.model.state_dict().items()}
    return results, weights


def _grpo_batch(lengths: list[int], prompt: int, group: int, vocab: int, seed: int = 0) -> TrainBatch:
    """Groups of `group` samples sharing a `prompt`-token prompt, sample i `lengths[i]` tokens long."""
    g = torch.Generator().manual_seed(seed)
    ids, mask = [], []
    for i, n in enumerate(lengths):
        if i % group == 0:
            shared = torch.randint(2, vocab, (prompt,), generator=g)
        ids.append(torch.cat([shared, torch.randint(2, vocab, (n - prompt,), generator=g)]))
        mask += [0.0] * prompt + [1.0] * (n - prompt)
    loss_mask = torch.tensor(mask)
    advantages = torch.cat([torch.full((n,), float(torch.randn(1, generator=g))) for n in lengths])
    return TrainBatch(input_ids=torch.cat(ids), seqlens=list(lengths), loss_mask=loss_mask,
                      rollout_logprobs=-torch.rand(len(mask), generator=g) * 3 * loss_mask, advantages=advantages,
                      prompt_lens=[prompt] * len(lengths))


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("options", [dict(micro_batch_tokens=192), dict(micro_batch_tokens=96, mixed_precision=True),
                                     dict(micro_batch_tokens=192, indexer_loss_coef=0.5)])
def test_the_warmup_passes_leave_the_steps_after_them_bit_for_bit_unchanged(tmp_path, options):
    """Warm-up passes (past the tiny preset's index_topk of 16), then two train calls: π_old, metrics and weights
    equal those of the same calls without them; on CPU warm_up itself compiles nothing and returns None. One torch
    thread: with two, a loaded machine (CI's two workers, or two busy processes beside it) gave the same calls
    different low bits of indexer_kl, on main before this test's change too."""
    checkpoint = _checkpoint(tmp_path, "tiny", 96)
    batch = _grpo_batch([24, 20, 30, 18, 26, 22, 19, 28], prompt=10, group=4, vocab=96)
    runs = []
    for warm in (True, False):
        worker = _worker(checkpoint, **dict(options))
        try:
            if warm:
                assert worker.warm_up(80) is None  # CPU
                cpu_state = torch.get_rng_state()
                worker.warmup_passes(80)
                assert torch.equal(torch.get_rng_state(), cpu_state)
                assert all(p.grad is None for p in worker.policy.model.parameters())
            runs.append(_train_twice(worker, batch))
        finally:
            worker.shutdown()
    (got, got_weights), (want, want_weights) = runs
    for (old, metrics), (old_ref, metrics_ref) in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(old, old_ref))
        assert metrics == metrics_ref
    assert all(torch.equal(got_weights[k], want_weights[k]) for k in want_weights)


@pytest.mark.gpu
def test_after_the_warmup_a_run_of_mixed_lengths_compiles_no_kernel(tmp_path):
    """The small preset (index_topk 256) warmed up for samples up to 416 tokens (countdown's 160 + 256), then train
    calls over groups of random lengths within and past index_topk, of both parities: no Triton kernel compiles."""
    checkpoint = _checkpoint(tmp_path, "small", 384)
    worker = _worker(checkpoint, micro_batch_tokens=16384, mixed_precision=True, ops_backend="auto")
    try:
        seconds = worker.warm_up(416)
        assert seconds is not None and seconds > 0
        before = compiled_kernels()
        rng = random.Random(0)
        for call, spread in enumerate(((40, 120), (200, 416), (40, 416), (40, 416))):
            lengths = [rng.randint(*spread) for _ in range(32)]
            batch = _grpo_batch(lengths, prompt=36, group=16, vocab=384, seed=call)
            worker.train_batches([batch], [(float(batch.loss_mask.sum()), 32)], recompute_old_logprobs=True)
        new = new_compiles(before, compiled_kernels())
    finally:
        worker.shutdown()
    assert not new, f"kernels compiled after the warm-up ({seconds:.1f} s): {new}"
