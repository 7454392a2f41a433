"""Index replay end to end on CPU: engine rollout -> Sample.indexer_topk -> TrainBatch -> an FSDP2 rank (gloo).

Here the engine returns the rows that produced output tokens only; tests/test_index_replay_prompt.py covers the
prompt rows (fragile prompt, reused prefix).

The fragile case: every index score of the model ties exactly (the indexers' query projection is zero), so the
selection is decided by the tie rule alone, and the engine runs a top-k whose tie rule differs from the trainer's
(later keys win, as torch.topk or a GPU kernel may do; the trainer's reference prefers earlier keys). Replay on:
the trainer's log-probs equal the engine's within 1e-5. Replay off: they do not, and the selection mismatch is
measured and logged as train/index_topk_mismatch.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from rollout.engine import Engine, GenerateRequest, SamplingParams
from slime_dsa import ops
from slime_dsa.checkpoint import build_model, save_pretrained
from slime_dsa.data.sample import Sample
from slime_dsa.models import ModelConfig, PackedBatch
from slime_dsa.models.glm_moe_dsa import REPLAY_COMPUTE
from slime_dsa.ops import reference
from slime_dsa.orchestrator.batching import build_train_batch, engine_topk_rows
from trainers.process_group import free_port

CONFIG = dict(
    vocab_size=53, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=12,
    q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, index_n_heads=4, index_head_dim=8,
    index_topk=6, indexer_types=["full", "shared", "full"], max_position_embeddings=256, eos_token_id=None,
)


@pytest.fixture(scope="module")
def tied_model():
    torch.set_num_threads(1)
    model = build_model(ModelConfig(**CONFIG), seed=0).eval()
    with torch.no_grad():
        for layer in model.config.full_layer_ids:
            model.model.layers[layer].self_attn.indexer.wq_b.weight.zero_()  # every index score is exactly 0
    return model


def later_keys_win_topk(q, k, weights, cu_seqlens_q, cu_seqlens_k, topk, scale, **_):
    """The reference top-k with the opposite tie rule (equal scores: the later key wins): a stand-in for another kernel."""
    out = torch.full((q.shape[0], topk), -1, dtype=torch.long)
    for i in range(len(cu_seqlens_q) - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_seqlens_q[i], cu_seqlens_q[i + 1], cu_seqlens_k[i], cu_seqlens_k[i + 1]))
        scores = reference.indexer_scores(q[q0:q1], k[k0:k1], weights[q0:q1], scale)
        pos = (k1 - k0) - (q1 - q0) + torch.arange(q1 - q0)
        valid = torch.arange(k1 - k0)[None, :] <= pos[:, None]
        flipped = reference.select_topk(scores.flip(-1), valid.flip(-1), topk)
        local = torch.where(flipped >= 0, (k1 - k0) - 1 - flipped, torch.iinfo(torch.long).max).sort(-1).values
        out[q0:q1] = torch.where(local == torch.iinfo(torch.long).max, -1, local)
    return out


def rollout(model, monkeypatch, n=3, prompt_len=5, new_tokens=12) -> list[Sample]:
    """Prompts of at most index_topk + 1 tokens: every prompt row before P - 1 selects all of its keys under any tie
    rule, so the rows that differ are exactly the rows the engine returns (it returns none for prompt rows)."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, CONFIG["vocab_size"], (prompt_len + i,), generator=g).tolist() for i in range(n)]
    with monkeypatch.context() as m:
        m.setattr(ops, "indexer_topk", later_keys_win_topk)
        # The packed forward in decode too: the stand-in replaces the packed top-k (the paged one is another op).
        engine = Engine(model, max_cache_tokens=512, block_size=4, seed=1, paged_decode=False)
        for i, p in enumerate(prompts):
            engine.add_request(GenerateRequest(p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), rid=str(i),
                                               return_indexer_topk=True))
        finals = {}
        while engine.has_work:
            finals.update({o.rid: o for o in engine.step() if o.finish_reason is not None})
    samples = []
    for i, p in enumerate(prompts):
        out = finals[str(i)]
        s = Sample(prompt_ids=p, index=i, group_id=0, reward=float(i), indexer_topk=out.indexer_topk)
        s.append_tokens(list(out.output_ids), list(out.output_token_logprobs))
        samples.append(s.validate())
    return samples


@pytest.fixture(scope="module")
def worker(tied_model, tmp_path_factory):
    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from trainers.base import DSAOptions, OptimizerConfig, policy_config  # noqa: PLC0415
    from trainers.fsdp.worker import FSDPWorker  # noqa: PLC0415

    path = tmp_path_factory.mktemp("tied")
    save_pretrained(tied_model, path)
    config = policy_config(str(path), PPOLoss(eps_low=0.2, eps_high=0.28), OptimizerConfig(learning_rate=1e-3),
                           dsa=DSAOptions(indexer_loss_coef=0.5, indexer_learning_rate=1e-2), ops_backend="torch",
                           micro_batch_tokens=64)
    w = FSDPWorker(0, 1, "127.0.0.1", free_port(), config)
    yield w
    w.shutdown()


def test_partial_replay_computes_sentinel_rows(tied_model):
    ids = torch.randint(0, CONFIG["vocab_size"], (15,), generator=torch.Generator().manual_seed(2))
    batch = PackedBatch.from_seqlens([15])
    with torch.no_grad():
        plain = tied_model.forward_packed(ids, batch, return_topk=True)
        all_sentinel = torch.full_like(plain.topk_indices, REPLAY_COMPUTE)
        same = tied_model.forward_packed(ids, batch, replay_topk=all_sentinel, return_topk=True)
        assert torch.equal(same.topk_indices, plain.topk_indices) and torch.equal(same.logits, plain.logits)
        partial = all_sentinel.clone()
        partial[:, 10:] = torch.tensor([4, 5, 6, 7, 8, 9])  # replayed rows: not what ties pick (0 .. 5)
        mixed = tied_model.forward_packed(ids, batch, replay_topk=partial, return_topk=True)
    assert torch.equal(mixed.topk_indices[:, :10], plain.topk_indices[:, :10])
    assert (mixed.topk_indices[:, 10:] == torch.tensor([4, 5, 6, 7, 8, 9])).all()
    assert torch.equal(mixed.logits[:10], plain.logits[:10]) and not torch.allclose(mixed.logits[10:], plain.logits[10:])


def test_engine_topk_rows_alignment():
    a = Sample(prompt_ids=[1, 2, 3], indexer_topk=np.arange(2 * 2 * 3).reshape(2, 2, 3))
    a.append_tokens([4, 5], [-0.1, -0.2])
    b = Sample(prompt_ids=[6, 7])  # no top-k: all of its rows are computed
    b.append_tokens([8], [-0.3])
    rows = engine_topk_rows([a, b])
    assert rows.shape == (2, 8, 3)
    assert (rows[:, [0, 1, 4, 5, 6, 7]] == REPLAY_COMPUTE).all()
    assert rows[:, 2:4].tolist() == torch.from_numpy(a.indexer_topk).permute(1, 0, 2).tolist()  # rows P-1 .. P+R-2
    assert engine_topk_rows([b]) is None
    batch = build_train_batch([a, b], torch.zeros(2), index_replay=True)
    assert batch.replay_topk is not None and batch.rollout_topk is None
    assert torch.equal(batch.select([0]).replay_topk, rows[:, :5])


def test_rows_from_a_start_row_and_from_either_engine():
    """Sample.indexer_topk_start places the rows; indexer_topk_rows reads ours (start given) and SGLang's (no start)."""
    c = Sample(prompt_ids=[1, 2, 3, 4], indexer_topk=np.arange(5 * 2 * 3).reshape(5, 2, 3), indexer_topk_start=1)
    c.append_tokens([5, 6, 7], [-0.1, -0.2, -0.3])  # rows 1 .. P+R-2 = 5
    rows = engine_topk_rows([c.validate()])
    assert (rows[:, 0] == REPLAY_COMPUTE).all() and (rows[:, 6] == REPLAY_COMPUTE).all()
    assert rows[:, 1:6].tolist() == torch.from_numpy(c.indexer_topk).permute(1, 0, 2).tolist()
    c.indexer_topk_start = 2
    with pytest.raises(ValueError, match=r"indexer_topk covers sequence rows 2 \.\. P\+R-2 and must have shape \(4,"):
        c.validate()

    from rollout.client import MalformedResponseError, indexer_topk_rows  # noqa: PLC0415
    from rollout.server.protocol import encode_int32  # noqa: PLC0415

    def meta(rows: int, start: int | None = None, shape: bool = True) -> dict:
        data, dims = encode_int32(np.zeros((rows, 2, 3), dtype=np.int32))
        m = {"prompt_tokens": 4, "completion_tokens": 3, "indexer_topk": data}
        m.update({"indexer_topk_shape": dims} if shape else {})
        return m if start is None else {**m, "indexer_topk_start": start}

    assert indexer_topk_rows(meta(3, 3))[1] == 3 and indexer_topk_rows(meta(0, 6))[0].shape == (0, 2, 3)
    assert indexer_topk_rows(meta(6))[1] == 0  # SGLang: every row but the last
    assert indexer_topk_rows(meta(3))[1] == 3  # one row per output token
    assert indexer_topk_rows({"prompt_tokens": 4, "completion_tokens": 3}) == (None, None)
    with pytest.raises(MalformedResponseError, match="covers rows 2 .. 4"):
        indexer_topk_rows(meta(3, 2))
    with pytest.raises(MalformedResponseError, match="indexer_topk_shape"):
        indexer_topk_rows(meta(6, shape=False))


def test_replay_matches_engine_logprobs_and_mismatch_is_logged(tied_model, worker, monkeypatch):
    samples = rollout(tied_model, monkeypatch)
    advantages = torch.tensor([-1.0, 0.0, 1.0])
    engine_logp = build_train_batch(samples, advantages).rollout_logprobs

    replayed = build_train_batch(samples, advantages, index_replay=True)
    mask = replayed.loss_mask.bool()
    logp = worker.compute_logprobs(replayed)
    assert (logp[mask] - engine_logp[mask]).abs().max().item() <= 1e-5

    compared = build_train_batch(samples, advantages)  # replay off: the engine's top-k is only compared
    assert compared.rollout_topk is not None and compared.replay_topk is None
    recomputed = worker.compute_logprobs(compared)
    assert (recomputed[mask] - engine_logp[mask]).abs().max().item() > 1e-3  # the fragile selection did flip
    compared.old_logprobs = recomputed
    metrics = worker.train_step(compared, float(compared.loss_mask.sum()), len(samples))
    assert 0.2 < metrics["index_topk_mismatch"] <= 1.0
    # The auxiliary indexer loss ran on its own param group and learning rate.
    assert metrics["indexer_kl"] > 0 and 0 < metrics["indexer_recall/0"] <= 1 and "indexer_kl/2" in metrics
    assert sorted({g["lr"] for g in worker.policy.optimizer.param_groups}) == [1e-3, 1e-2]

    replayed.old_logprobs = logp
    metrics = worker.train_step(replayed, float(replayed.loss_mask.sum()), len(samples), detailed_metrics=False)
    assert "index_topk_mismatch" not in metrics  # replay on: training attends to exactly the rollout's keys
    assert metrics["indexer_kl"] > 0 and not any(k.startswith("indexer_recall") for k in metrics)  # a step not logged
