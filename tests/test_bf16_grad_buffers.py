"""One mixed-precision rank keeps its master's float32 gradients across steps (trainers/fsdp/bf16_compute.py): a
skipped non-finite step leaves no trace in the next, and a resumed rank trains as the one that saved. Real parts:
FSDPWorker ranks of one over gloo in this process, the tiny checkpoint, 2 micro-batches a step."""

from __future__ import annotations

import math

import pytest
import torch

from tests.hf_reference import make_hf_checkpoint
from tests.test_data_parallel import NUM_SAMPLES, _batch
from trainers.process_group import free_port


def _worker(checkpoint: str):
    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from trainers.base import OptimizerConfig, policy_config  # noqa: PLC0415
    from trainers.fsdp.worker import FSDPWorker  # noqa: PLC0415

    # The indexer gets no gradient without its loss: frozen, as in test_data_parallel (training it resumes exactly
    # too: tests/test_checkpoints.py).
    config = policy_config(checkpoint, PPOLoss(), OptimizerConfig(learning_rate=1e-2), frozen=(".indexer.",),
                           ops_backend="torch", mixed_precision=True, micro_batch_tokens=27)
    return FSDPWorker(0, 1, "127.0.0.1", free_port(), config)


def _step(worker, batch) -> dict[str, float]:
    batch.old_logprobs = worker.compute_logprobs(batch)
    return worker.train_step(batch, float(batch.loss_mask.sum()), NUM_SAMPLES)


def _weights(worker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker.policy.model.state_dict().items()}


def test_kept_gradients_are_clean_after_a_skipped_step_and_across_a_resume(tmp_path):
    if torch.cuda.is_available():  # bit-equal runs of two ranks need CPU kernels (CUDA's scatter-adds are atomic)
        pytest.skip("FSDPWorker takes the GPU when there is one; this compares CPU runs bit for bit")
    make_hf_checkpoint(tmp_path / "ckpt", index_topk=4)
    skipper, fresh = _worker(str(tmp_path / "ckpt")), _worker(str(tmp_path / "ckpt"))
    try:
        assert skipper.bf16_copies and len(skipper.micro_batches(_batch(), skipper.policy.config)) == 2
        poisoned = _batch()
        poisoned.advantages[poisoned.loss_mask.bool().nonzero()[0]] = float("nan")
        assert _step(skipper, poisoned)["skipped_updates"] == 1.0
        kept = {n: p.grad for n, p in skipper.policy.model.named_parameters() if p.grad is not None}
        assert any(not torch.isfinite(g).all() for g in kept.values())  # the skipped step's values stay behind
        assert _step(skipper, _batch()) == _step(fresh, _batch())  # same metrics, grad_norm included
        after = _weights(fresh)
        assert all(torch.equal(v, after[k]) for k, v in _weights(skipper).items())
        for name, p in skipper.policy.model.named_parameters():  # the same tensors, rewritten in place
            assert p.grad is None or (p.grad is kept[name] and math.isfinite(p.grad.norm())), name

        skipper.save_checkpoint(str(tmp_path / "saved"))
        resumed = _worker(str(tmp_path / "ckpt"))
        resumed.load_checkpoint(str(tmp_path / "saved"))
        assert _step(resumed, _batch()) == _step(skipper, _batch())
        after = _weights(skipper)
        assert all(torch.equal(v, after[k]) for k, v in _weights(resumed).items())
    finally:
        skipper.shutdown()
