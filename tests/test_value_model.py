"""The value model (SAO's critic): the policy's backbone under a scalar head, its per-token value layout, its frozen
attention, its files; and the value role of a real FSDP2 rank (one process, gloo) trained on masked MSE."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from slime_dsa.checkpoint import build_model, load_value_model, save_pretrained, save_value_model
from slime_dsa.models import PackedBatch
from slime_dsa.models.presets import preset_config
from slime_dsa.models.value_model import VALUE_FROZEN
from trainers.base import TrainBatch
from trainers.process_group import free_port

VOCAB = 64


@pytest.fixture
def policy_dir(tmp_path):
    """A tiny policy with an MTP layer (the value model leaves it out)."""
    model = build_model(preset_config("tiny", vocab_size=VOCAB, num_nextn_predict_layers=1), seed=0)
    return save_pretrained(model, tmp_path / "policy"), model


def _batch(seed: int = 0) -> TrainBatch:
    """Four trajectories: prompt, action tokens, a tool span (loss_mask 0), more action tokens; targets in [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    ids, mask, seqlens = [], [], []
    for s in range(4):
        layout = [0] * 5 + [1] * 6 + [0] * 3 + [1] * (4 + s)
        ids += torch.randint(0, VOCAB, (len(layout),), generator=g).tolist()
        mask += layout
        seqlens.append(len(layout))
    n = len(ids)
    mask_t = torch.tensor(mask, dtype=torch.float32)
    return TrainBatch(input_ids=torch.tensor(ids), seqlens=seqlens, loss_mask=mask_t,
                      rollout_logprobs=torch.zeros(n), advantages=torch.zeros(n),
                      returns=torch.rand(n, generator=g) * mask_t, prompt_lens=[5] * 4)


def test_values_are_laid_out_like_logprobs(policy_dir):
    path, policy = policy_dir
    critic = load_value_model(path, seed=1).eval()
    assert critic.config.num_nextn_predict_layers == 0
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(1))
    batch = PackedBatch.from_seqlens([5, 7])
    with torch.no_grad():
        values, final = critic.token_values(ids, batch)
        hidden = critic.forward_hidden(ids, batch).hidden_states
        after = hidden @ critic.value_head.weight[0] + critic.value_head.bias[0]  # V after each token
    assert values[0] == 0 and values[5] == 0  # nothing before a sequence's first token
    torch.testing.assert_close(values[1:5], after[0:4])  # V(s_t) is read from the row before token t
    torch.testing.assert_close(values[6:], after[5:11])
    torch.testing.assert_close(final, after[[4, 11]])  # after each sequence's last token


def test_initialised_from_the_policy_then_saved_and_loaded_by_name(policy_dir, tmp_path):
    path, policy = policy_dir
    critic = load_value_model(path, seed=3)
    pol = policy.state_dict()
    backbone = {k: v for k, v in critic.state_dict().items() if not k.startswith("value_head.")}
    assert set(backbone) == {k for k in pol if k.startswith("model.") and not k.startswith("model.layers.2.")}
    assert all(torch.equal(v, pol[k]) for k, v in backbone.items())  # the policy's backbone, MTP layer left out
    assert critic.value_head.weight.abs().sum() > 0 and torch.equal(load_value_model(path, seed=3).value_head.weight,
                                                                     critic.value_head.weight)  # seeded head
    out = save_value_model(critic, tmp_path / "value")
    names = set(load_file(out / "model.safetensors"))
    assert {"value_head.weight", "value_head.bias"} <= names and not any(n.startswith("lm_head") for n in names)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["GlmMoeDsaForValue"]
    again = load_value_model(out)
    assert all(torch.equal(a, b) for a, b in zip(critic.state_dict().values(), again.state_dict().values()))


def test_critic_role_trains_everything_but_the_frozen_attention(policy_dir, tmp_path):
    """Three value-loss steps on a rank: attention (MLA, indexer) and the embedding are bit-equal, everything else
    moved; values and checkpoints come back through the rank's interface."""
    from slime_dsa.algorithms import ValueLoss
    from trainers.base import OptimizerConfig, RankConfig, RoleConfig
    from trainers.fsdp.worker import FSDPWorker

    path, _ = policy_dir
    role = RoleConfig(str(path), OptimizerConfig(learning_rate=2e-3), ValueLoss(value_clip=None), VALUE_FROZEN,
                      kind="value")
    worker = FSDPWorker(0, 1, "127.0.0.1", free_port(), RankConfig(roles={"critic": role}, ops_backend="torch",
                                                                     micro_batch_tokens=48))
    try:
        model = worker.roles["critic"].model
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        batch = _batch()
        values, final = worker.compute_values(batch)
        assert values.shape == (batch.num_tokens,) and final.shape == (4,)
        batch.old_values = values
        tokens = float(batch.loss_mask.sum())
        losses = [worker.train_step(batch, tokens, 4, role="critic")["value_loss"] for _ in range(3)]
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
        frozen = [k for k in before if any(part in k for part in VALUE_FROZEN)]
        assert any(".indexer." in k for k in frozen) and any("kv_b_proj" in k for k in frozen)
        for name, param in model.named_parameters():
            moved = not torch.equal(param.detach(), before[name])
            assert moved != (name in frozen), f"{name}: {'moved' if moved else 'did not move'}"
        worker.save_checkpoint(str(tmp_path / "ckpt"))
        critic_dir = tmp_path / "ckpt" / "critic"
        assert (critic_dir / "rng_rank0.safetensors").exists()  # a group without the policy: under its first role
        saved = load_value_model(critic_dir)  # the checkpoint's critic/ is a value-model directory
        assert all(torch.equal(saved.state_dict()[k], v.detach()) for k, v in model.state_dict().items())
    finally:
        worker.shutdown()
