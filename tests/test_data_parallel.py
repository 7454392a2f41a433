"""Two training ranks (gloo, real processes): replicate and FSDP2 take the same step as one rank on the whole batch.

Each rank trains on half the samples; losses are normalised by the global counts, so after one optimiser step the
weights must equal those of a single rank that saw every sample (float32, up to summation order).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from tests.hf_reference import TINY, make_hf_checkpoint
from trainers.base import TrainBatch
from trainers.process_group import free_port

pytestmark = pytest.mark.slow  # spawns rank processes that build process groups

NUM_SAMPLES, PROMPT, RESPONSE = 6, 5, 4


def _batch() -> TrainBatch:
    """Three groups of two samples sharing a prompt, with advantages of both signs."""
    g = torch.Generator().manual_seed(0)
    ids, loss_mask, adv, plens = [], [], [], []
    for s in range(NUM_SAMPLES):
        if s % 2 == 0:
            prompt = torch.randint(0, TINY["vocab_size"], (PROMPT,), generator=g).tolist()
        ids += prompt + torch.randint(0, TINY["vocab_size"], (RESPONSE,), generator=g).tolist()
        loss_mask += [0.0] * PROMPT + [1.0] * RESPONSE
        adv += [0.0] * PROMPT + [1.0 if s % 3 else -1.0] * RESPONSE
        plens.append(PROMPT)
    n = len(ids)
    return TrainBatch(input_ids=torch.tensor(ids), seqlens=[PROMPT + RESPONSE] * NUM_SAMPLES,
                      loss_mask=torch.tensor(loss_mask), rollout_logprobs=torch.full((n,), -2.0),
                      advantages=torch.tensor(adv), old_logprobs=None, prompt_lens=plens)


def _train_one_step(rank: int, world_size: int, port: int, ckpt: str, data_parallel: str, out: str,
                    compile: bool = False) -> None:
    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from trainers.base import OptimizerConfig, policy_config  # noqa: PLC0415
    from trainers.fsdp.worker import FSDPWorker  # noqa: PLC0415

    torch.set_num_threads(1)
    config = policy_config(ckpt, PPOLoss(), OptimizerConfig(learning_rate=1e-2), frozen=(".indexer.",), ops_backend="torch",
                           data_parallel=data_parallel, compile=compile)
    worker = FSDPWorker(rank, world_size, "127.0.0.1", port, config)
    layers = worker.policy.model.model.layers
    assert [hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in layers] == [compile] * len(layers)
    batch = _batch()
    loss_tokens = float(batch.loss_mask.sum())
    # pairs of samples stay together so each rank still shares prompts
    share = [i for i in range(NUM_SAMPLES) if (i // 2) % world_size == rank]
    mine = batch.select(share)
    mine.old_logprobs = worker.compute_logprobs(mine)
    metrics = worker.train_step(mine, loss_tokens, NUM_SAMPLES)
    assert torch.isfinite(torch.tensor(metrics["grad_norm"]))
    worker.save_weights(out)
    # Both ranks leave together: a rank tearing gloo down while rank 0 still writes aborted once on a loaded CI box.
    torch.distributed.barrier()
    worker.shutdown()


def _run(world_size: int, ckpt, data_parallel: str, out, compile: bool = False) -> dict[str, torch.Tensor]:
    port = free_port()
    mp.start_processes(_train_one_step, args=(world_size, port, str(ckpt), data_parallel, str(out), compile),
                       nprocs=world_size, start_method="spawn")
    return load_file(out)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dp")
    make_hf_checkpoint(directory / "ckpt", index_topk=4)
    before = load_file(next((directory / "ckpt").glob("*.safetensors")))
    after = _run(1, directory / "ckpt", "fsdp", directory / "single.safetensors")
    return directory, before, after


@pytest.mark.parametrize("data_parallel", ["replicate", "fsdp"])
def test_two_ranks_match_one(single, data_parallel):
    directory, before, expected = single
    got = _run(2, directory / "ckpt", data_parallel, directory / f"{data_parallel}.safetensors")
    changed = [k for k in expected if not torch.equal(expected[k], before[k])]
    assert len(changed) > 10  # the step moved the weights (Adam moves each by ~lr = 1e-2; 1e-5 is rounding)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.skipif(not os.environ.get("SLIME_DSA_COMPILE_TESTS"), reason="compiles on two ranks at once: ~4 min on "
                    "2 cores, beyond CI's budget; SLIME_DSA_COMPILE_TESTS=1 runs it (passed 2026-12-06, 243 s). The "
                    "compiled rank against the eager one runs always (tests/test_trainer_compile.py)")
def test_two_compiled_fsdp_ranks_match_one(single):
    """trainer.compile on two FSDP2 ranks (each layer compiled, then sharded, torchtitan's order): the step's weights
    match the single eager rank's within a tenth of lr. Not 1e-5: inductor's fused kernels round differently, and
    AdamW's first step moves a weight whose gradient is near 0 by up to lr times that gradient's relative change
    (tests/test_trainer_compile.py)."""
    directory, before, expected = single
    got = _run(2, directory / "ckpt", "fsdp", directory / "compiled.safetensors", compile=True)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-3, msg=lambda m, n=name: f"{n}: {m}")
