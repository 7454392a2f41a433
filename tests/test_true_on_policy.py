"""True on-policy (issue 23, model.true_on_policy): with batch-invariant ops the engine's log-probs equal the trainer's
bit for bit, whatever the batch on either side.

The engine samples at max_running_requests 1, 7 and 64 from prompts of mixed lengths (its decode batches differ in
size and composition; prefill and decode rows both produce tokens); each sample is then scored by the trainer in a
packed batch of another composition (other samples, another order, micro-batches cut elsewhere). Switch off, the same
test shows a gap: it cannot pass vacuously. The `gpu` case runs the model-level check in bfloat16 on CUDA.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rollout.engine import Engine, GenerateRequest, SamplingParams
from slime_dsa.checkpoint import build_model, load_model, save_pretrained
from slime_dsa.data.sample import Sample
from slime_dsa.models import PackedBatch
from slime_dsa.models.presets import preset_config
from slime_dsa.ops import invariant
from slime_dsa.orchestrator.batching import build_train_batch
from trainers.process_group import free_port

VOCAB = 97
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
NEW_TOKENS = 16  # prompts of 3 .. 40 tokens: sequences reach past the tiny preset's index_topk (16), so DSA selects


@pytest.fixture(scope="module", autouse=True)
def invariant_off_afterwards(one_thread):
    """One thread for engine and trainer alike (tests/conftest.py); the invariant mode off after the module."""
    yield
    invariant.set_enabled(False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_pretrained(build_model(preset_config("tiny", VOCAB), seed=0), path)
    return path


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(3, 41, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def rollout(model, prompt_list: list[list[int]], temperature: float, batch: int, replay: bool,
            samples_per_prompt: int = 1, cuda_graphs: bool = True, stats: dict | None = None) -> list[Sample]:
    """Samples of the prompts from an engine that runs at most `batch` requests at once (its stats into `stats`)."""
    cache_tokens = max(1 << 14, samples_per_prompt * sum(len(p) + NEW_TOKENS + 16 for p in prompt_list))
    engine = Engine(model, max_cache_tokens=cache_tokens, block_size=16, seed=0, max_running_requests=batch,
                    keep_indexer_topk=replay, cuda_graphs=cuda_graphs)
    requests = [GenerateRequest(p, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=temperature, ignore_eos=True,
                                                  sampling_seed=1000 * i + j),
                                rid=f"{i}/{j}", return_indexer_topk=replay, indexer_topk_start_len=0 if replay else -1)
                for i, p in enumerate(prompt_list) for j in range(samples_per_prompt)]
    for req in requests:
        engine.add_request(req)
    finals = {}
    while engine.has_work:
        finals.update({o.rid: o for o in engine.step() if o.finish_reason is not None})
    if stats is not None:
        stats.update(engine.stats, decode_graphs=engine.decoder is not None and engine.decoder.use_cuda_graphs)
    samples = []
    for n, req in enumerate(requests):
        out = finals[req.rid]
        s = Sample(prompt_ids=list(req.input_ids), index=n, group_id=int(req.rid.split("/")[0]), reward=0.0,
                   indexer_topk=out.indexer_topk, indexer_topk_start=out.indexer_topk_start)
        s.append_tokens(list(out.output_ids), list(out.output_token_logprobs))
        samples.append(s.validate())
    return samples


def trainer_gap(worker, samples: list[Sample], others: list[Sample], temperature: float, replay: bool) -> torch.Tensor:
    """|trainer − engine log-prob| of every generated token of `samples`, scored in a batch of another composition:
    `others` interleaved, the order reversed."""
    mixed = [s for pair in zip(reversed(samples), others) for s in pair] + list(reversed(samples))[len(others):]
    batch = build_train_batch(mixed, torch.zeros(len(mixed)), index_replay=replay)
    worker.config = dataclasses.replace(worker.config, temperature=temperature)
    logp = worker.compute_logprobs(batch)
    mine = torch.zeros(len(mixed), dtype=torch.bool)
    ours = {id(s) for s in samples}
    mine[[i for i, s in enumerate(mixed) if id(s) in ours]] = True
    tokens = batch.loss_mask.bool() & torch.repeat_interleave(mine, torch.tensor([s.total_length for s in mixed]))
    assert int(tokens.sum()) == sum(s.response_length for s in samples)
    return (logp[tokens] - batch.rollout_logprobs[tokens]).abs()


def make_worker(checkpoint, **rank):
    """An FSDP2 rank of one (on CUDA when torch sees it, as in a run) with the switch on."""
    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from trainers.base import OptimizerConfig, policy_config  # noqa: PLC0415
    from trainers.fsdp.worker import FSDPWorker  # noqa: PLC0415

    config = policy_config(str(checkpoint), PPOLoss(eps_low=0.2, eps_high=0.28), OptimizerConfig(learning_rate=3e-3),
                           micro_batch_tokens=300, true_on_policy=True, **rank)
    return FSDPWorker(0, 1, "127.0.0.1", free_port(), config)


@pytest.fixture(scope="module")
def worker(checkpoint):
    w = make_worker(checkpoint, ops_backend="torch")
    yield w
    w.shutdown()


@pytest.fixture(scope="module")
def engine_model(checkpoint, worker):
    """The engine's model, float32 on the trainer's device."""
    return load_model(checkpoint, device=worker.device).eval()


@pytest.mark.parametrize("replay", [False, True], ids=["replay-off", "replay-on"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_engine_and_trainer_logprobs_are_bitwise_equal(worker, engine_model, batch, temperature, replay):
    assert invariant.is_enabled()  # the worker turned it on for this process, as the recipe key does
    n = max(batch, 9)
    samples = rollout(engine_model, prompts(n, seed=batch), temperature, batch, replay)
    others = rollout(engine_model, prompts(5, seed=100 + batch), temperature, 64, replay)
    gap = trainer_gap(worker, samples, others, temperature or 1.0, replay)
    assert gap.numel() == n * NEW_TOKENS and torch.equal(gap, torch.zeros_like(gap)), f"max |Δ| {float(gap.max())}"


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_engine_and_mixed_precision_trainer_are_bitwise_equal(checkpoint, device):
    """Issue 23's acceptance in bfloat16 on the tiny preset: a bf16 engine against the trainer's bf16 compute copy
    (trainer.mixed_precision, float32 master), greedy and sampled; on CUDA also replay on, and batch 256."""
    worker = make_worker(checkpoint, mixed_precision=True)  # not shut down: that would end the shared process group
    assert worker.device.type == device
    model = load_model(checkpoint, dtype="bfloat16", device=device).eval()
    for batch in (1, 7, 64) + ((256,) if device == "cuda" else ()):
        for temperature in (0.0, 0.8):
            for replay in (False, True) if device == "cuda" else (False,):  # CPU: float32 covers replay
                samples = rollout(model, prompts(max(batch, 9), seed=batch), temperature, batch, replay)
                others = rollout(model, prompts(5, seed=100 + batch), temperature, 64, replay)
                gap = trainer_gap(worker, samples, others, temperature or 1.0, replay)
                assert torch.equal(gap, torch.zeros_like(gap)), (
                    f"batch {batch}, T {temperature}, replay {replay}: max |Δ| {float(gap.max())}, "
                    f"exact {float((gap == 0).float().mean()):.3f}")


def test_groups_share_prompts_and_stay_bitwise_equal(worker, engine_model):
    """Samples of one prompt fork in the engine (one prefill, cache rows copied) and share the prompt's forward in
    the trainer (share_prompt_prefix): still the same bits."""
    samples = rollout(engine_model, prompts(6, seed=7), 0.8, 16, False, samples_per_prompt=4)
    gap = trainer_gap(worker, samples, [], 0.8, False)
    assert torch.equal(gap, torch.zeros_like(gap)), f"max |Δ| {float(gap.max())}"


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_switch_off_leaves_a_gap(worker, engine_model, batch):
    """The control: the same comparison without the mode differs (GEMV vs GEMM, dense vs sparse attention, ...)."""
    with invariant.enabled(False):
        n = max(batch, 9)
        samples = rollout(engine_model, prompts(n, seed=batch), 0.8, batch, False)
        others = rollout(engine_model, prompts(5, seed=100 + batch), 0.8, 64, False)
        gap = trainer_gap(worker, samples, others, 0.8, False)
    assert gap.max() > 0 and gap.max() < 1e-5  # close (the CPU float32 contract) but not equal


def test_still_bitwise_after_three_rl_steps_with_weight_syncs(checkpoint):
    """Three RL steps through the trainer and engine objects (not the Ray loop): roll out, check, train, push the
    new weights to the engine, and roll out again; the weights changed and the log-probs still agree bit for bit."""
    worker = make_worker(checkpoint, ops_backend="torch", temperature=1.0)  # its own weights: it trains them
    engine_model = load_model(checkpoint, device=worker.device).eval()
    engine = Engine(engine_model, max_cache_tokens=1 << 14, block_size=16, seed=0, max_running_requests=7)
    start = {k: v.clone() for k, v in engine_model.state_dict().items()}
    for step in range(3):
        samples = rollout(engine.model, prompts(8, seed=50 + step), 1.0, 7, False)
        batch = build_train_batch(samples, torch.linspace(-1, 1, len(samples)))
        batch.old_logprobs = batch.rollout_logprobs.clone()
        metrics = worker.train_step(batch, float(batch.loss_mask.sum()), len(samples), measure_sync=True)
        assert metrics["sync_logprob_exact"] == 1.0 and metrics["sync_logprob_abs_diff_max"] == 0.0
        engine.update_weights(worker.full_state_dict(), str(step + 1))
    moved = max((engine_model.state_dict()[k] - v).abs().max().item() for k, v in start.items())
    assert moved > 1e-4
    samples = rollout(engine.model, prompts(8, seed=99), 1.0, 7, False)
    gap = trainer_gap(worker, samples, [], 1.0, False)
    assert torch.equal(gap, torch.zeros_like(gap))


# ----------------------------------------------------------------------------------------------
# The primitives, and the model on any device


def _each_row_alone(fn, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([fn(x[r : r + 1]) for r in range(x.shape[0])])


@pytest.mark.parametrize("shape", [(64, 32), (128, 97), (16, 64), (96, 128), (32, 8)])
def test_linear_rows_do_not_depend_on_the_batch(shape):
    K, N = shape
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(77, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    assert torch.equal(invariant.linear(x, w, b), _each_row_alone(lambda r: invariant.linear(r, w, b), x))
    assert torch.allclose(invariant.linear(x, w, b), F.linear(x, w, b), atol=1e-5)
    heads = torch.randn(3, K, N, generator=g)
    xh = torch.randn(77, 3, K, generator=g)
    assert torch.equal(invariant.head_matmul(xh, heads), _each_row_alone(lambda r: invariant.head_matmul(r, heads), xh))
    assert torch.allclose(invariant.head_matmul(xh, heads), torch.einsum("thk,hkn->thn", xh, heads), atol=1e-4)


@pytest.mark.parametrize("fn", [torch.sigmoid, F.silu, torch.cos, torch.exp], ids=["sigmoid", "silu", "cos", "exp"])
def test_elementwise_rows_do_not_depend_on_the_batch(fn):
    x = torch.randn(77, 8, generator=torch.Generator().manual_seed(1)) * 4
    assert torch.equal(invariant.rowwise(fn, x), _each_row_alone(lambda r: invariant.rowwise(fn, r), x))
    whole = F.pad(x, (0, 0, 0, (-77) % invariant.ROW_CHUNK))  # one call over whole pieces: all vectorised
    assert torch.equal(invariant.rowwise(fn, x), fn(whole)[:77])


def test_elementwise_ops_alone_differ_from_batched_on_cpu():
    """Why `rowwise` exists: a row computed alone (a decode step) takes the scalar tail, and some bits differ."""
    x = torch.randn(1000, 8, generator=torch.Generator().manual_seed(4)) * 4
    differs = {fn.__name__: int(sum(not torch.equal(fn(x[r : r + 1])[0], fn(x)[r]) for r in range(1000)))
               for fn in (torch.sigmoid, F.silu, torch.exp, torch.cos)}
    assert sum(differs.values()) > 0, differs


@pytest.mark.parametrize("V", [97, 1000])
def test_row_kernels_are_row_wise(V):
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(77, 64, generator=g), torch.randn(64, generator=g)
    assert torch.equal(invariant.rms_norm(x, w, 1e-6), _each_row_alone(lambda r: invariant.rms_norm(r, w, 1e-6), x))
    logits, ids = torch.randn(77, V, generator=g), torch.randint(0, V, (77,), generator=g)
    full = invariant.log_softmax_gather(logits, ids, 0.7)
    alone = torch.cat([invariant.log_softmax_gather(logits[r : r + 1], ids[r : r + 1], 0.7) for r in range(77)])
    assert torch.equal(full, alone)
    assert torch.allclose(full, torch.log_softmax(logits / 0.7, -1).gather(1, ids[:, None]).squeeze(1))


def test_attention_and_indexer_agree_with_the_reference_and_with_themselves_alone():
    """Blockwise attention over a query's selected rows: the reference's result (close), and each row's bits the same
    whatever the other rows and the width of the batch's index table."""
    from slime_dsa.ops import reference  # noqa: PLC0415

    g = torch.Generator().manual_seed(3)
    lens = [5, 70, 33, 140]
    cu = F.pad(torch.tensor(lens).cumsum(0), (1, 0))
    T = int(cu[-1])
    q, kv = torch.randn(T, 2, 24, generator=g), torch.randn(T, 24, generator=g)
    iq, ik, iw = torch.randn(T, 4, 16, generator=g), torch.randn(T, 16, generator=g), torch.rand(T, 4, generator=g)
    local = invariant.indexer_topk(iq, ik, iw, cu, cu, 32, 0.25)
    assert torch.equal(local, reference.indexer_topk(iq, ik, iw, cu, cu, 32, 0.25))
    rows = PackedBatch.from_seqlens(lens).to_rows(local)
    out, lse = invariant.mla_attention(q, kv, rows, 0.2, 16)
    ref_out, ref_lse = reference.sparse_mla_attention(q, kv, rows, 0.2, 16)
    assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5)
    wide = F.pad(rows, (0, 100), value=-1)  # a wider table (another batch's top-k) changes no bit
    for r in (0, 40, T - 1):
        one, one_lse = invariant.mla_attention(q[r : r + 1], kv, wide[r : r + 1], 0.2, 16)
        assert torch.equal(one, out[r : r + 1]) and torch.equal(one_lse, lse[r : r + 1])


def test_gradients_of_the_invariant_ops():
    """The trainer differentiates through them: linear's plain backward and attention's recomputed reference."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(45, 3, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(8, 16, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(8, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(invariant.linear, (x, w, b))
    packed = PackedBatch.from_seqlens([5, 20])
    cols = torch.arange(8)
    rows = packed.to_rows(torch.where(cols <= packed.positions[:, None], cols, -1))  # a top-k of 8
    q = torch.randn(25, 2, 6, dtype=torch.float64, generator=g, requires_grad=True)
    kv = torch.randn(25, 6, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, kv: invariant.mla_attention(q, kv, rows, 0.3, 4), (q, kv))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_model_level_bitwise_on_device(device, temperature):
    """The engine against the model's own packed forward (no trainer worker), in the engine's dtype: float32 on CPU,
    bfloat16 on CUDA (the H200 check of issue 23)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = build_model(preset_config("tiny", VOCAB), dtype=dtype, device=device, seed=0).eval()
    with invariant.enabled(True):
        for batch in (1, 7, 64):
            samples = rollout(model, prompts(max(batch, 9), seed=batch), temperature, batch, False)
            random.Random(batch).shuffle(samples)
            ids = torch.tensor([t for s in samples for t in s.tokens], device=device)
            packed = PackedBatch.from_seqlens([s.total_length for s in samples], device)
            with torch.no_grad():
                logp, _ = model.token_logprobs(ids, packed, temperature=temperature or 1.0)
            starts = packed.cu_seqlens_q[:-1].tolist()
            for s, start in zip(samples, starts):
                trainer = logp[start + len(s.prompt_ids) : start + s.total_length].cpu()
                assert torch.equal(trainer, torch.tensor(s.rollout_logprobs)), (batch, s.index)


@pytest.mark.gpu
def test_invariant_decode_runs_in_cuda_graphs():
    """On CUDA the mode's kernels wait on no host, so the engine decodes in CUDA graphs; replayed graphs give the
    eager engine's tokens and log-probs bit for bit."""
    model = build_model(preset_config("tiny", VOCAB), dtype=torch.bfloat16, device="cuda", seed=0).eval()
    with invariant.enabled(True):
        stats: dict = {}
        graphed = rollout(model, prompts(9, seed=3), 0.8, 7, False, stats=stats)
        assert stats["decode_graphs"] and stats["graph_captures"] > 0, stats
        eager = rollout(model, prompts(9, seed=3), 0.8, 7, False, cuda_graphs=False)
    for a, b in zip(graphed, eager):
        assert a.tokens == b.tokens and a.rollout_logprobs == b.rollout_logprobs, a.index


@pytest.mark.slow  # ~3 min of CPU: the tiny model's every matmul through Triton's interpreter
def test_bitwise_through_the_triton_kernels_in_the_interpreter():
    """The dispatch to slime_dsa.ops.triton_invariant (CUDA's path) agrees with the interface this module expects."""
    pytest.importorskip("triton")
    pytest.importorskip("slime_dsa.ops.triton_invariant")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "tests.true_on_policy_interpret"], cwd=root, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]


# ----------------------------------------------------------------------------------------------
# The recipe key


@pytest.mark.parametrize("override, message", [
    ({"trainer": {"backend": "deepspeed", "data_parallel": "fsdp"}}, "trainer.backend 'fsdp' only"),
    ({"cluster": {"num_gpus_per_engine": 1, "num_gpus_per_trainer": 1}},  # engines in bf16 (dtype auto on GPU)
     "the engines compute in bfloat16 (model.dtype auto), the trainer in float32"),
    ({"rollout": {"top_p": 0.9}}, "rollout.top_p 1 and top_k -1"),
    ({"rollout": {"top_k": 20}}, "rollout.top_p 1 and top_k -1"),
    ({"trainer": {"mixed_precision": True}}, "the engines compute in float32 (model.dtype auto), the trainer in bfloat16"),
    ({"model": {"true_on_policy": True, "dtype": "bfloat16"}}, "the trainer in float32 (trainer.mixed_precision false)"),
    ({"rollout": {"engine": "external", "engine_urls": ["http://x:1"]}}, "rollout.engine 'embedded' only"),
])
def test_recipe_refuses_what_is_not_built(override, message):
    from slime_dsa.config import RecipeError, validate_recipe  # noqa: PLC0415

    base = {"model": {"true_on_policy": True}}
    assert validate_recipe(base).model.true_on_policy  # the CPU default is built, and bf16 with mixed precision
    assert validate_recipe({"model": {"true_on_policy": True, "dtype": "bfloat16"}, "trainer": {"mixed_precision": True}})
    with pytest.raises(RecipeError, match=re.escape(message)) as err:
        validate_recipe({**base, **override})
    assert "\n" not in str(err.value)


def test_recipe_allows_the_gpu_recipe():
    """recipes/gpu_single.yaml with the switch on: GPU engines and trainer, bf16 engines with the trainer's bf16
    compute copy (trainer.mixed_precision), as the Triton kernels run it."""
    from slime_dsa.config import load_recipe  # noqa: PLC0415

    root = Path(__file__).resolve().parents[1]
    recipe = load_recipe(root / "recipes" / "gpu_single.yaml", ["model.true_on_policy=true"])
    assert recipe.model.true_on_policy and recipe.cluster.num_gpus_per_engine > 0
    assert recipe.model.dtype == "bfloat16" and recipe.trainer.mixed_precision
