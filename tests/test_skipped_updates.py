"""An optimiser step whose global gradient norm is not finite is skipped, and the step's metrics say so: grad_norm
stays non-finite and skipped_updates counts it (summed over a call's optimiser steps). Real parts: one FSDP rank
over gloo in this process, the tiny checkpoint."""

from __future__ import annotations

import math

import pytest
import torch

from tests.hf_reference import make_hf_checkpoint
from tests.test_data_parallel import NUM_SAMPLES, _batch
from trainers.process_group import free_port
from trainers.rank import combine_steps


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from trainers.base import OptimizerConfig, policy_config  # noqa: PLC0415
    from trainers.fsdp.worker import FSDPWorker  # noqa: PLC0415

    path = tmp_path_factory.mktemp("skip") / "ckpt"
    make_hf_checkpoint(path, index_topk=4)
    config = policy_config(str(path), PPOLoss(), OptimizerConfig(learning_rate=1e-2), ops_backend="torch")
    w = FSDPWorker(0, 1, "127.0.0.1", free_port(), config)
    yield w
    w.shutdown()


def _weights(worker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker.policy.model.state_dict().items()}


def test_a_non_finite_gradient_skips_the_update_and_counts_it(worker):
    batch = _batch()
    batch.old_logprobs = worker.compute_logprobs(batch)
    tokens = float(batch.loss_mask.sum())
    poisoned = _batch()
    poisoned.old_logprobs = batch.old_logprobs
    poisoned.advantages[batch.loss_mask.bool().nonzero()[0]] = float("nan")  # one trained token: a NaN gradient
    before = _weights(worker)
    metrics = worker.train_step(poisoned, tokens, NUM_SAMPLES)
    assert math.isnan(metrics["grad_norm"]) and metrics["skipped_updates"] == 1.0
    assert all(torch.equal(v, before[k]) for k, v in _weights(worker).items())  # no update
    metrics = worker.train_step(batch, tokens, NUM_SAMPLES)
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0 and metrics["skipped_updates"] == 0.0
    assert any(not torch.equal(v, before[k]) for k, v in _weights(worker).items())  # a normal update
    # every advantage 0 (a GRPO step whose groups all agree): loss and gradient exactly 0, not a skip
    flat = _batch()
    flat.old_logprobs = worker.compute_logprobs(flat)
    flat.advantages.zero_()
    metrics = worker.train_step(flat, tokens, NUM_SAMPLES)
    assert metrics["loss"] == 0.0 and metrics["grad_norm"] == 0.0 and metrics["skipped_updates"] == 0.0


def test_a_call_sums_its_skipped_updates_and_keeps_a_non_finite_norm():
    steps = [{"loss": 1.0, "grad_norm": float("nan"), "lr": 1e-3, "skipped_updates": 1.0},
             {"loss": 3.0, "grad_norm": 2.0, "lr": 2e-3, "skipped_updates": 0.0},
             {"loss": 2.0, "grad_norm": 4.0, "lr": 3e-3, "skipped_updates": 1.0}]
    got = combine_steps(steps)
    assert got["loss"] == 2.0 and got["lr"] == 3e-3 and got["skipped_updates"] == 2.0
    assert math.isnan(got["grad_norm"])
