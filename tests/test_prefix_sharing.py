"""Shared-prompt packing for training: the same log-probs, entropies and gradients as the flat pack.

A random GLM-MoE-DSA checkpoint with index_topk (4) below the sequence lengths, so the responses' sparse
selection reaches into the shared prompt, and IndexShare layers. CPU, float64 where exactness is asserted.
"""

from __future__ import annotations


import pytest
import torch

import slime_dsa
from slime_dsa.models import PackedBatch
from slime_dsa.models.prefix_sharing import pack_shared_prefixes
from tests.hf_reference import TINY, make_hf_checkpoint
from trainers.process_group import free_port

VOCAB = TINY["vocab_size"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    make_hf_checkpoint(directory, index_topk=4, num_hidden_layers=4, index_topk_freq=2)
    return directory


def _groups(prompt_lens: list[int], response_lens: list[list[int]], seed: int = 0):
    """Flat ids, seqlens and prompt_lens of consecutive groups: group g has one prompt and len(response_lens[g])
    responses."""
    g = torch.Generator().manual_seed(seed)
    ids, seqlens, plens = [], [], []
    for p, responses in zip(prompt_lens, response_lens):
        prompt = torch.randint(0, VOCAB, (p,), generator=g).tolist()
        for r in responses:
            ids += prompt + torch.randint(0, VOCAB, (r,), generator=g).tolist()
            seqlens.append(p + r)
            plens.append(p)
    return torch.tensor(ids), seqlens, plens


def test_pack_layout():
    ids, seqlens, plens = _groups([3, 2], [[2, 0, 1], [2]])
    pack = pack_shared_prefixes(ids, seqlens, plens)
    # rows: prompt A (3), A's responses (2, 1: the empty one has no sequence), prompt B (2), B's response (2)
    assert pack.num_rows == 3 + 2 + 1 + 2 + 2
    assert pack.batch.cu_seqlens_q.tolist() == [0, 3, 5, 6, 8, 10]
    assert pack.batch.cu_seqlens_k.tolist() == [0, 3, 8, 12, 14, 18]
    assert pack.batch.positions.tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 2, 3]
    assert pack.batch.kv_cache.key_rows.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 6, 7, 8, 9]
    # response tokens of the flat layout (samples at 0, 5, 8, 12) and the row holding the token before each
    assert pack.response_index.tolist() == [3, 4, 11, 14, 15]
    assert pack.response_rows.tolist() == [2, 3, 2, 7, 8]
    for t, row in zip(pack.response_index.tolist(), pack.response_rows.tolist()):
        assert pack.input_ids[row] == ids[t - 1]
    # nothing shared, nothing to do
    ids, seqlens, plens = _groups([3, 2], [[2], [2]])
    assert pack_shared_prefixes(ids, seqlens, plens) is None
    with pytest.raises(ValueError, match="prompt_lens"):
        pack_shared_prefixes(ids, seqlens, [0, 2])


def test_same_logprobs_entropy_and_gradients_as_flat(checkpoint):
    model = slime_dsa.load_model(checkpoint, dtype=torch.float64)
    ids, seqlens, plens = _groups([7, 5, 9], [[6, 3, 11, 1], [4], [8, 0, 5]], seed=1)
    flat = PackedBatch.from_seqlens(seqlens)
    pack = pack_shared_prefixes(ids, seqlens, plens)
    assert pack.num_rows < len(ids)
    weights = torch.rand(len(ids), dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def run(prefix_pack):
        model.zero_grad()
        logp, ent = model.token_logprobs(ids, flat, return_entropy=True, prefix_pack=prefix_pack)
        (logp * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logp.detach(), ent.detach(), grads

    response = torch.cat([torch.tensor([False] * p + [True] * (n - p)) for n, p in zip(seqlens, plens)])
    weights = weights * response  # what a policy loss sees: response tokens only
    logp_a, ent_a, grads_a = run(None)
    logp_b, ent_b, grads_b = run(pack)
    torch.testing.assert_close(logp_b[response], logp_a[response], rtol=0, atol=1e-12)
    torch.testing.assert_close(ent_b[response], ent_a[response], rtol=0, atol=1e-12)
    assert not logp_b[~response].any() and not ent_b[~response].any()  # prompt tokens: 0
    assert set(grads_a) == set(grads_b)
    for name in grads_a:  # RMSNorm and the router compute in float32 even here: float32-level sums
        scale = float(grads_a[name].abs().max())
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-6 * scale, msg=name)


def test_trainer_step_is_the_same_with_and_without_sharing(checkpoint):
    """A real FSDPWorker step (π_old, loss, AdamW) with share_prompt_prefix on and off: same π_old and metrics.

    (Weights after one AdamW step are not compared: its first update is ±lr for any non-zero gradient, so
    float32 noise on a near-zero gradient flips whole steps.)"""
    from trainers.base import TrainBatch  # noqa: PLC0415
    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from trainers.base import OptimizerConfig, policy_config  # noqa: PLC0415
    from trainers.fsdp.worker import FSDPWorker  # noqa: PLC0415

    ids, seqlens, plens = _groups([7, 5], [[6, 3, 4], [4, 2]], seed=3)
    mask = torch.cat([torch.tensor([0.0] * p + [1.0] * (n - p)) for n, p in zip(seqlens, plens)])
    adv = torch.cat([torch.full((n,), a) for n, a in zip(seqlens, [1.0, -0.5, -0.5, 0.7, -0.7])])
    results = {}
    for share in (False, True):
        config = policy_config(str(checkpoint), PPOLoss(), OptimizerConfig(learning_rate=1e-2), frozen=(".indexer.",),
                               ops_backend="torch", share_prompt_prefix=share)
        worker = FSDPWorker(0, 1, "127.0.0.1", free_port(), config)
        try:
            batch = TrainBatch(input_ids=ids, seqlens=seqlens, loss_mask=mask, rollout_logprobs=torch.zeros(len(ids)),
                               advantages=adv, prompt_lens=plens)
            old, metrics = worker.train_batches([batch], [(float(mask.sum()), len(seqlens))], recompute_old_logprobs=True)
            results[share] = (old[0], metrics[0])
            assert metrics[0]["grad_norm"] > 0
        finally:
            worker.shutdown()
    (old_a, m_a), (old_b, m_b) = results[False], results[True]
    torch.testing.assert_close(old_b[mask > 0], old_a[mask > 0], rtol=0, atol=1e-6)  # prompt tokens: 0 when shared
    assert set(m_a) == set(m_b)
    for key in m_a:
        assert m_b[key] == pytest.approx(m_a[key], rel=1e-4, abs=1e-6), key


def test_fsdp_mixed_precision_casts_packed_inputs(checkpoint):
    """FSDP2 with a bf16 param dtype (trainer.mixed_precision on GPU) casts the forward's inputs and rebuilds each
    dataclass argument (PackedBatch, SharedPrefixPack) with dataclasses.replace(**every field): the batch must
    survive that (a derived init=False field made every mixed-precision step fail on CUDA). CPU, one gloo rank."""
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import register_fsdp_forward_method  # noqa: PLC0415

    from slime_dsa.checkpoint import load_model  # noqa: PLC0415
    from trainers.fsdp.parallelize import apply_fsdp  # noqa: PLC0415

    ids, seqlens, plens = _groups([7, 5], [[6, 3, 4], [4, 2]], seed=3)
    plain = load_model(str(checkpoint), dtype=torch.float32, device="cpu")
    with torch.no_grad():
        expect = plain.token_logprobs(ids, PackedBatch.from_seqlens(seqlens))[0]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        model = apply_fsdp(load_model(str(checkpoint), dtype=torch.float32, device="cpu"),
                           init_device_mesh("cpu", (1,)), mixed_precision=True)
        register_fsdp_forward_method(model, "token_logprobs_with_output")
        pack = pack_shared_prefixes(ids, seqlens, plens, torch.device("cpu"))
        logp, _, _ = model.token_logprobs_with_output(ids, PackedBatch.from_seqlens(seqlens), prefix_pack=pack)
        logp.sum().backward()
    finally:
        dist.destroy_process_group()
    response = torch.cat([torch.arange(p, n) + start for n, p, start in
                          zip(seqlens, plens, [0, *torch.tensor(seqlens).cumsum(0).tolist()[:-1]])])
    torch.testing.assert_close(logp[response].float(), expect[response], rtol=0, atol=0.1)  # bf16 compute


def test_micro_batch_budget_counts_a_shared_prompt_once():
    from slime_dsa.models.prefix_sharing import shared_prompt_lengths  # noqa: PLC0415
    from trainers.base import split_by_tokens  # noqa: PLC0415

    ids, seqlens, plens = _groups([6, 4], [[4, 4, 4], [6]])
    shared = shared_prompt_lengths(ids, seqlens, plens)
    assert seqlens == [10, 10, 10, 10] and shared == [0, 6, 6, 0]
    assert split_by_tokens(seqlens, 20) == [[0, 1], [2, 3]]
    assert split_by_tokens(seqlens, 20, shared) == [[0, 1, 2], [3]]  # 10 + 4 + 4 rows
    assert split_by_tokens(seqlens, 15, shared) == [[0, 1], [2], [3]]  # a new micro-batch pays the whole prompt


def test_ranks_get_whole_groups_so_no_prompt_is_computed_twice():
    from slime_dsa.models.prefix_sharing import shared_prompt_lengths  # noqa: PLC0415
    from trainers.base import balance_across_ranks  # noqa: PLC0415

    # Four groups of four samples: whole groups per rank, two each (equal rows), every sample once.
    ids, seqlens, plens = _groups([20, 20, 20, 20], [[2, 9, 3, 8], [5, 5, 5, 5], [9, 2, 8, 3], [5, 6, 4, 5]])
    shared = shared_prompt_lengths(ids, seqlens, plens)
    flat = [{i // 4 for i in rank} for rank in balance_across_ranks(seqlens, 2)]
    assert flat[0] & flat[1]  # the flat balance splits groups: both ranks compute their prompts
    grouped = balance_across_ranks(seqlens, 2, shared)
    assert sorted(len({i // 4 for i in rank}) for rank in grouped) == [2, 2]
    assert all(rank == sorted(rank) and {i // 4 for i in rank} == {g for g in range(4) if 4 * g in rank}
               for rank in grouped)
    assert sorted(i for rank in grouped for i in rank) == list(range(16))

    # One group and two ranks: cut in two contiguous pieces (each pays the prompt) rather than one idle rank.
    ids, seqlens, plens = _groups([20], [[2, 3, 4, 5]])
    shared = shared_prompt_lengths(ids, seqlens, plens)
    assert sorted(balance_across_ranks(seqlens, 2, shared)) == [[0, 1], [2, 3]]
    # Without sharing (replay, indexer loss) samples are balanced one by one, as before.
    assert sorted(balance_across_ranks([5, 6, 7, 8], 3)) == [[0, 1], [2], [3]]
