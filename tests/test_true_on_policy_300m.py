"""True on-policy at issue 23's size: the 300m preset (`benchmarks/engine_throughput.py`), bf16 on CUDA.

The engine samples, greedy and at temperature 0.8, with at most 1, 7, 64 and 256 running requests, from prompts longer
than the preset's index_topk (256), so DSA selects keys in prefill, decode and training; index replay off and on. The
FSDP2 trainer's bf16 compute copy scores every sample in packed micro-batches of another composition (other samples
interleaved, the order reversed). Every generated token's log-prob must be equal bit for bit.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.test_true_on_policy import rollout, trainer_gap

pytestmark = pytest.mark.gpu

PROMPT_TOKENS = (260, 420)  # past index_topk 256 before the first generated token


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from benchmarks.engine_throughput import model_config  # noqa: PLC0415
    from slime_dsa.checkpoint import build_model, save_pretrained  # noqa: PLC0415

    path = tmp_path_factory.mktemp("p300m")
    save_pretrained(build_model(model_config("300m"), seed=0), path)
    return path


@pytest.fixture(scope="module")
def worker(checkpoint):
    """One FSDP2 rank on the GPU, trainer.mixed_precision (the bf16 compute copy), the switch on."""
    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from slime_dsa.ops import invariant  # noqa: PLC0415
    from trainers.base import OptimizerConfig, policy_config  # noqa: PLC0415
    from trainers.fsdp.worker import FSDPWorker  # noqa: PLC0415
    from trainers.process_group import free_port  # noqa: PLC0415

    config = policy_config(str(checkpoint), PPOLoss(eps_low=0.2, eps_high=0.28), OptimizerConfig(learning_rate=1e-5),
                           micro_batch_tokens=6000, true_on_policy=True, mixed_precision=True)
    w = FSDPWorker(0, 1, "127.0.0.1", free_port(), config)
    yield w  # not shut down: other modules' workers share the process group
    invariant.set_enabled(False)


@pytest.fixture(scope="module")
def engine_model(checkpoint, worker):
    from slime_dsa.checkpoint import load_model  # noqa: PLC0415

    return load_model(checkpoint, dtype="bfloat16", device=worker.device).eval()


def long_prompts(n: int, seed: int, vocab: int = 32000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(*PROMPT_TOKENS))] for _ in range(n)]


@pytest.mark.parametrize("replay", [False, True], ids=["replay-off", "replay-on"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("batch", [1, 7, 64, 256])
def test_300m_engine_and_trainer_logprobs_are_bitwise_equal(worker, engine_model, batch, temperature, replay):
    n = max(batch, 9)
    samples = rollout(engine_model, long_prompts(n, seed=batch), temperature, batch, replay)
    others = rollout(engine_model, long_prompts(5, seed=1000 + batch), temperature, 64, replay)
    gap = trainer_gap(worker, samples, others, temperature or 1.0, replay)
    assert gap.numel() == sum(s.response_length for s in samples)
    assert torch.equal(gap, torch.zeros_like(gap)), (
        f"max |Δ| {float(gap.max())}, exact {float((gap == 0).float().mean()):.4f}")
