"""One mixed-precision rank trains with a bf16 copy of its float32 weights (trainers/fsdp/bf16_compute.py) exactly
as FSDP2's bf16 MixedPrecisionPolicy would on a group of one: the same log-probs, gradients and updates, bit for bit
(on CPU over gloo here; on the GPU through FSDPWorker)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from slime_dsa.checkpoint.hf_format import build_model
from slime_dsa.models import PackedBatch
from slime_dsa.models.presets import preset_config
from slime_dsa.models.glm_moe_dsa import Experts
from trainers.fsdp.bf16_compute import Bf16Compute, GradBuffers
from trainers.process_group import free_port


@pytest.fixture
def one_rank_group():
    """A gloo group of one rank in this process (left as found)."""
    created = not dist.is_initialized()
    if created:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield torch.distributed.device_mesh.init_device_mesh("cpu", (1,))
    if created:
        dist.destroy_process_group()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _bf16_grouped_mm_on_cpu() -> bool:
    """Whether this torch runs the experts' grouped GEMM in bf16 on CPU (the path a GPU takes in bf16)."""
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    try:
        grouped_mm(torch.ones(4, 16, dtype=torch.bfloat16), torch.ones(2, 16, 16, dtype=torch.bfloat16),
                   offs=torch.tensor([2, 4], dtype=torch.int32))
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return True


@pytest.fixture(params=["loop", "grouped"])
def expert_path(request):
    """The experts' per-expert loop (CPU's bf16 default) or their grouped GEMM (a GPU's bf16 default)."""
    if request.param == "grouped" and not _bf16_grouped_mm_on_cpu():
        pytest.skip("this torch has no bf16 grouped_mm on CPU")
    Experts.use_grouped_mm = request.param == "grouped"
    yield request.param
    Experts.use_grouped_mm = None


@pytest.mark.parametrize("micro_batches", [[[20, 28]], [[20, 28], [32, 16]], [[24], [8, 16], [40]]])
def test_bf16_copy_trains_as_fsdp2_mixed_precision(one_rank_group, micro_batches, expert_path):
    """3 steps of 1, 2 or 3 micro-batches: the same log-probs, gradients and weights as FSDP2's bf16 policy. FSDP2
    sums micro-batches in float32 (its reduce_dtype), so the copy must too: summed in bf16 by autograd in the copy's
    .grad and cast once, the gradients differed from the second micro-batch on. The copy's experts compute with
    stacked leaves, FSDP2's with the per-expert weights."""
    from trainers.fsdp.parallelize import apply_fsdp  # noqa: PLC0415

    config = preset_config("tiny", vocab_size=96, eos_token_id=1)
    fsdp = apply_fsdp(build_model(config, seed=0, dtype=torch.float32), one_rank_group, mixed_precision=True)
    master = build_model(config, seed=0, dtype=torch.float32)
    copy = Bf16Compute(master)
    assert next(copy.module.parameters()).dtype == torch.bfloat16
    assert all(b.dtype == torch.float32 for b in copy.module.buffers())  # as FSDP2 leaves them
    opt_fsdp = torch.optim.AdamW(fsdp.parameters(), lr=1e-2, foreach=False)
    opt_copy = torch.optim.AdamW(master.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        for seqlens in micro_batches:
            ids = torch.randint(0, config.vocab_size, (sum(seqlens),), generator=g)
            packed = PackedBatch.from_seqlens(seqlens)
            logp_fsdp = fsdp.token_logprobs(ids, packed)[0]
            logp_copy = copy.module.token_logprobs(ids, packed)[0]
            assert torch.equal(logp_fsdp, logp_copy), step
            (-logp_fsdp.mean()).backward()
            (-logp_copy.mean()).backward()
            copy.accumulate_gradients()
        assert all(c.grad is None for c in copy.module.parameters())
        for (name, a), b in zip(fsdp.named_parameters(), master.parameters()):
            assert (a.grad is None) == (b.grad is None), name
            assert a.grad is None or torch.equal(_full(a.grad), b.grad), (step, name)
        opt_fsdp.step()
        opt_copy.step()
        opt_fsdp.zero_grad(set_to_none=True)
        copy.zero_grad()
        copy.refresh()
    for (name, a), b, c in zip(fsdp.named_parameters(), master.parameters(), copy.module.parameters()):
        assert torch.equal(_full(a).detach(), b.detach()), name
        assert torch.equal(c.detach(), b.detach().to(c.dtype)), name  # bf16 but the float32 router and indexer head


def test_float32_router_and_indexer_head_are_not_rounded(one_rank_group, tmp_path):
    """A checkpoint whose router weights, selection biases and indexer heads hold float32 values bf16 cannot hold
    (the rest bf16): the engine's bf16 model and the bf16 copy hold them as the file does, and these two and FSDP2's
    mixed precision give bit-identical log-probs. (Before, cast rounded all three through bf16 and FSDP2 and the copy
    rounded the router weight and indexer head but not the bias: log-probs max 0.13 apart.)"""
    from slime_dsa.checkpoint.hf_format import load_model  # noqa: PLC0415
    from tests.megatron_conformance import BF16_SEQLENS, BF16_SHAPE, float32_tensors, save_bf16_checkpoint  # noqa: PLC0415
    from trainers.fsdp.parallelize import apply_fsdp  # noqa: PLC0415

    save_bf16_checkpoint(tmp_path, float32_router=True)
    in_file = float32_tensors(tmp_path)
    assert len(in_file) == 8 and all(not torch.equal(t, t.bfloat16().float()) for t in in_file.values())
    engine = load_model(tmp_path, dtype=torch.bfloat16)
    copy = Bf16Compute(load_model(tmp_path, dtype=torch.float32))
    fsdp = apply_fsdp(load_model(tmp_path, dtype=torch.float32), one_rank_group, mixed_precision=True)
    for model in (engine, copy.module):
        held = model.state_dict()
        assert held["lm_head.weight"].dtype == torch.bfloat16
        for name, value in in_file.items():
            assert held[name].dtype == torch.float32 and torch.equal(held[name], value), name
    ids = torch.randint(0, BF16_SHAPE["vocab_size"], (sum(BF16_SEQLENS),), generator=torch.Generator().manual_seed(0))
    batch = PackedBatch.from_seqlens(BF16_SEQLENS)
    with torch.no_grad():
        logp = {name: model.eval().token_logprobs(ids, batch)[0]
                for name, model in (("engine", engine), ("copy", copy.module), ("fsdp", fsdp))}
    assert torch.equal(logp["copy"], logp["engine"]) and torch.equal(logp["fsdp"], logp["engine"])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_one_rank_mixed_precision_worker_trains_through_its_copy(tmp_path, device):
    """FSDPWorker on one mixed-precision rank builds the bf16 copy and trains through it (2 steps); afterwards its
    log-probs equal those FSDP2's mixed precision computes from the worker's float32 weights, so the copy followed
    every update."""
    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from slime_dsa.checkpoint.hf_format import load_model, save_pretrained  # noqa: PLC0415
    from trainers.base import OptimizerConfig, TrainBatch, policy_config  # noqa: PLC0415
    from trainers.fsdp.parallelize import apply_fsdp  # noqa: PLC0415
    from trainers.fsdp.worker import FSDPWorker  # noqa: PLC0415

    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("FSDPWorker takes the GPU when there is one; the cuda case covers it")
    config = preset_config("tiny", vocab_size=96, eos_token_id=1)
    start = build_model(config, seed=0, dtype=torch.float32)
    save_pretrained(start, tmp_path / "m")
    rank = policy_config(str(tmp_path / "m"), PPOLoss(), OptimizerConfig(learning_rate=1e-3), mixed_precision=True,
                         micro_batch_tokens=32)  # 2 micro-batches a step
    worker = FSDPWorker(0, 1, "127.0.0.1", free_port(), rank)
    try:
        assert worker.bf16_copies and not worker.sharded
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, config.vocab_size, (64,), generator=g)
        batch = TrainBatch(input_ids=ids, seqlens=[32, 32], loss_mask=torch.ones(64),
                           rollout_logprobs=torch.full((64,), -2.0), advantages=torch.randn(64, generator=g))
        for _ in range(2):
            batch.old_logprobs = worker.compute_logprobs(batch)
            worker.train_step(batch, 64.0, 2)
        trained = worker.full_state_dict()
        assert not torch.equal(trained["lm_head.weight"], start.state_dict()["lm_head.weight"].cpu())
        reference = load_model(tmp_path / "m", dtype=torch.float32, device=worker.device)
        reference.load_state_dict(trained)
        reference = apply_fsdp(reference, worker.mesh, True)
        with torch.no_grad():
            ref_logp = reference.token_logprobs(ids.to(worker.device), PackedBatch.from_seqlens([32, 32], worker.device))
        assert torch.equal(worker.compute_logprobs(batch), ref_logp[0].float().cpu())
    finally:
        worker.shutdown()


def _two_rank_fsdp2(rank: int, port: int, checkpoint: str, out: str) -> None:
    """One of 2 gloo ranks: FSDP2 mixed precision (the routers and indexer heads in their own float32 shards) against
    the bf16 copy, on the same batch on both ranks; rank 0 writes what differs."""
    import json  # noqa: PLC0415

    from slime_dsa.checkpoint.hf_format import load_model  # noqa: PLC0415
    from tests.megatron_conformance import BF16_SHAPE  # noqa: PLC0415
    from trainers.fsdp.parallelize import apply_fsdp  # noqa: PLC0415

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    fsdp = apply_fsdp(load_model(checkpoint, dtype=torch.float32),
                      torch.distributed.device_mesh.init_device_mesh("cpu", (2,)), mixed_precision=True)
    copy = Bf16Compute(load_model(checkpoint, dtype=torch.float32))
    ids = torch.randint(0, BF16_SHAPE["vocab_size"], (160,), generator=torch.Generator().manual_seed(0))
    batch = PackedBatch.from_seqlens([96, 64])
    logp_fsdp, logp_copy = fsdp.token_logprobs(ids, batch)[0], copy.module.token_logprobs(ids, batch)[0]
    (-logp_fsdp.mean()).backward()
    (-logp_copy.mean()).backward()
    copy.accumulate_gradients()
    grads = [name for (name, a), b in zip(fsdp.named_parameters(), copy.master.parameters())
             if (a.grad is None) != (b.grad is None) or (a.grad is not None and not torch.equal(_full(a.grad), b.grad))]
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"logprobs_equal": torch.equal(logp_fsdp, logp_copy), "grads_differ": grads}, f)
    dist.destroy_process_group()


def test_two_fsdp2_ranks_compute_the_float32_router_as_the_copy(tmp_path):
    """FSDP2 on 2 ranks with mixed precision, where the routers and indexer heads are sharded apart under a float32
    policy (checkpoint as above): the same log-probs and gradients as the bf16 copy of one rank, bit for bit."""
    import json  # noqa: PLC0415

    import torch.multiprocessing as mp  # noqa: PLC0415

    from tests.megatron_conformance import save_bf16_checkpoint  # noqa: PLC0415

    save_bf16_checkpoint(tmp_path / "m", float32_router=True)
    out = tmp_path / "out.json"
    mp.start_processes(_two_rank_fsdp2, args=(free_port(), str(tmp_path / "m"), str(out)), nprocs=2,
                       start_method="spawn")
    assert json.loads(out.read_text()) == {"logprobs_equal": True, "grads_differ": []}


def _set_copy_grads(copy: Bf16Compute, grads: dict[int, torch.Tensor]) -> None:
    """What a backward leaves: the copy's .grad of the parameters at these indices (the rest None)."""
    for i, c in enumerate(copy.module.parameters()):
        c.grad = grads[i].to(c.dtype) if i in grads else None


def test_master_gradients_are_allocated_once_and_written_fresh_each_step():
    """The master's float32 gradients are the same tensors every step (no per-parameter allocation), even after a
    set_to_none elsewhere; a step's first micro-batch overwrites them, so a skipped step's NaNs do not leak into the
    next; a parameter no micro-batch reaches keeps .grad None, as the optimizer expects."""
    master = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    copy = Bf16Compute(master)
    optimizer = torch.optim.AdamW(master.parameters(), fused=True)
    g = torch.Generator().manual_seed(0)
    shapes = [p.shape for p in master.parameters()]
    draws = [{i: torch.randn(s, generator=g) for i, s in enumerate(shapes)} for _ in range(4)]

    _set_copy_grads(copy, draws[0])
    copy.accumulate_gradients()
    kept = [p.grad for p in master.parameters()]
    for grad in kept:
        grad.fill_(float("nan"))  # a non-finite step, skipped: its gradients stay behind
    copy.zero_grad()
    optimizer.zero_grad(set_to_none=True)
    _set_copy_grads(copy, {i: draws[1][i] for i in (0, 1, 2)})  # the last bias gets no gradient this micro-batch
    copy.accumulate_gradients()
    assert master[1].bias.grad is None
    _set_copy_grads(copy, {i: draws[2][i] for i in (0, 1)})
    copy.accumulate_gradients()
    for i, (p, grad) in enumerate(zip(master.parameters(), kept)):
        if i == 3:
            assert p.grad is None
            continue
        assert p.grad is grad and p.grad.data_ptr() == grad.data_ptr(), i
        want = draws[1][i].bfloat16().float() + (draws[2][i].bfloat16().float() if i < 2 else 0)
        assert torch.equal(p.grad, want), i
    copy.zero_grad()
    _set_copy_grads(copy, draws[3])
    copy.accumulate_gradients()
    assert all(p.grad is grad for p, grad in zip(master.parameters(), kept))
    assert all(torch.equal(p.grad, draws[3][i].bfloat16().float()) for i, p in enumerate(master.parameters()))


def _clip_setup():
    """A tiny master and its bf16 copy after one backward, with one trainable parameter left unreached and its
    kept gradient poisoned as a skipped step would leave it."""
    config = preset_config("tiny", vocab_size=96, eos_token_id=1)
    master = build_model(config, seed=0, dtype=torch.float32)
    copy = Bf16Compute(master)
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    (-copy.module.token_logprobs(ids, PackedBatch.from_seqlens([24, 16]))[0].mean()).backward()
    copy.accumulate_gradients()
    trainable = [p for p in master.parameters() if p.requires_grad]
    unreached = next(p for p in trainable if p.grad is not None)
    unreached.grad = None
    copy._grads[unreached].fill_(float("nan"))
    return copy, trainable, unreached


@pytest.mark.parametrize("max_norm", [1e-3, 1e3])  # clipped, and not
def test_clip_through_the_flat_buffer_is_torchs_clip(max_norm):
    """The bf16 copy's clip (one norm and one multiply over its flat gradient buffer) gives torch's clip_grad_norm_:
    the same norm (to float32 rounding of a different summation order) and the same scaled gradients; an unreached
    parameter's stale buffer neither counts nor gets a gradient."""
    copy, trainable, unreached = _clip_setup()
    holders = [torch.empty_like(p) for p in trainable]  # torch's clip reads .grad
    for holder, p in zip(holders, trainable):
        holder.grad = None if p.grad is None else p.grad.clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(holders, max_norm)
    expected_grads = [holder.grad for holder in holders]
    norm = copy.clip_grad_norm(trainable, max_norm)
    torch.testing.assert_close(norm, expected_norm, rtol=1e-6, atol=0)
    assert unreached.grad is None and torch.count_nonzero(copy._grads[unreached]) == 0
    for p, expected in zip(trainable, expected_grads):
        assert (p.grad is None) == (expected is None)
        if expected is not None:
            torch.testing.assert_close(p.grad, expected, rtol=1e-6, atol=1e-12)


def test_clip_through_the_flat_buffer_is_a_few_ops_and_declines_other_lists():
    """Four ops however many parameters (torch's clip walks each gradient: ~4 ops a parameter); a list that is not
    the master's trainable parameters, or a gradient outside the buffer, is left to torch (None)."""
    copy, trainable, _ = _clip_setup()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        copy.clip_grad_norm(trainable, 1.0)
    ops = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
    assert len(trainable) > 40 and len(ops) <= 8, [e.name for e in ops]
    assert copy.clip_grad_norm(trainable[1:], 1.0) is None
    assert copy.clip_grad_norm(list(reversed(trainable)), 1.0) is None
    reached = next(p for p in trainable if p.grad is not None)
    reached.grad = reached.grad.clone()
    assert copy.clip_grad_norm(trainable, 1.0) is None


def _accumulated(loss: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a backward of `loss` accumulates gradients into (its graph's AccumulateGrad nodes)."""
    seen, stack, found = set(), [loss.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            found.append(node.variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def test_the_copys_experts_are_two_stacked_leaves_a_layer(expert_path):
    """Each MoE layer of the copy accumulates two gradients (its stacked gate-up and down leaves), not three per
    expert; the leaves hold the per-expert weights' storage, so a refresh reaches them; their gradients land in the
    master's per-expert gradients, views of one span of the flat buffer."""
    config = preset_config("tiny", vocab_size=96, eos_token_id=1)
    master = build_model(config, seed=0, dtype=torch.float32)
    copy = Bf16Compute(master)
    layers = [m for m in copy.module.modules() if isinstance(m, Experts)]
    assert layers and all(m.leaves is not None for m in layers)
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    loss = -copy.module.token_logprobs(ids, PackedBatch.from_seqlens([24, 16]))[0].mean()
    accumulated = {id(t) for t in _accumulated(loss)}
    leaves = {id(leaf) for m in layers for leaf in m.leaves}
    assert leaves <= accumulated
    per_expert = {id(p) for m in layers for p in m.parameters()}
    assert not per_expert & accumulated
    assert accumulated <= {id(p) for p in copy.module.parameters() if p.requires_grad} | leaves
    loss.backward()
    copy.accumulate_gradients()
    for master_layer, copy_layer in zip((m for m in master.modules() if isinstance(m, Experts)), layers):
        gate_up, down = copy_layer.leaves
        assert gate_up.grad is None and down.grad is None
        assert all(w.grad is not None for w in master_layer.parameters())
        gate_ups = [w for expert in master_layer for w in (expert.gate_proj.weight, expert.up_proj.weight)]
        span = copy._grads.span(gate_ups)
        assert all(w.grad.data_ptr() == span.data_ptr() + i * w.numel() * 4 for i, w in enumerate(gate_ups))
    with torch.no_grad():
        for p in master.parameters():
            p.add_(0.5)
    copy.refresh()
    for master_layer, copy_layer in zip((m for m in master.modules() if isinstance(m, Experts)), layers):
        gate_up, down = copy_layer.leaves
        assert torch.equal(gate_up[0, : gate_up.shape[1] // 2], master_layer[0].gate_proj.weight.bfloat16())
        assert torch.equal(down[-1], master_layer[-1].down_proj.weight.bfloat16())


def test_a_moved_copy_is_refused_rather_than_computing_with_its_old_leaves():
    """The leaves are attributes, not parameters: a .to() moves the per-expert weights away from them, and the next
    forward says so instead of computing with (and training) the leaves' stale values."""
    config = preset_config("tiny", vocab_size=96, eos_token_id=1)
    copy = Bf16Compute(build_model(config, seed=0, dtype=torch.float32))
    copy.module.to(torch.float32)
    with pytest.raises(RuntimeError, match="no longer views of the stacked leaves"):
        copy.module.token_logprobs(torch.arange(8), PackedBatch.from_seqlens([8]))


def test_experts_partly_frozen_keep_their_own_weights():
    """A layer whose experts do not all train keeps per-expert weights in the copy (a leaf trains as a whole)."""
    config = preset_config("tiny", vocab_size=96, eos_token_id=1)
    master = build_model(config, seed=0, dtype=torch.float32)
    layers = [m for m in master.modules() if isinstance(m, Experts)]
    layers[0][0].up_proj.weight.requires_grad_(False)
    copy = Bf16Compute(master)
    copied = [m for m in copy.module.modules() if isinstance(m, Experts)]
    assert copied[0].leaves is None and all(m.leaves is not None for m in copied[1:])
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    (-copy.module.token_logprobs(ids, PackedBatch.from_seqlens([24, 16]))[0].mean()).backward()
    copy.accumulate_gradients()
    assert layers[0][0].up_proj.weight.grad is None and layers[0][0].gate_proj.weight.grad is not None


def test_grad_buffers_lay_out_a_span_in_the_order_given():
    params = [torch.zeros(2, 3), torch.zeros(4), torch.zeros(3, 1)]
    buffers = GradBuffers(params, layout=[params[2], params[0]])
    assert buffers.span([params[2], params[0]]).numel() == 9
    assert buffers[params[1]].data_ptr() == buffers.flat.data_ptr() + 9 * 4
    with pytest.raises(ValueError, match="not consecutive"):
        buffers.span([params[0], params[2]])
