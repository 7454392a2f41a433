"""trainer.compile: the FSDP2 rank with each decoder layer torch.compile'd (trainers/fsdp/parallelize.apply_compile)
trains as the eager rank does, over packed micro-batches whose lengths change every step without recompiling, and
the recipe refuses what it is not built for."""

from __future__ import annotations

import os

import pytest
import torch

from slime_dsa.config import RecipeError, validate_recipe
from tests.test_rank_step import _checkpoint, _grpo_batch

VOCAB = 96


@pytest.fixture(autouse=True)
def _dynamo_config_restored():
    """apply_compile sets dynamo's specialize_float and inductor's mix_order_reduction for the process: restored after
    each test (config.patch; pytest's monkeypatch deletes a dynamo config entry on undo, which broke every later
    compile in the process)."""
    import torch._inductor.config as inductor_config  # noqa: PLC0415

    with torch._dynamo.config.patch(specialize_float=torch._dynamo.config.specialize_float), inductor_config.patch(
            {"triton.mix_order_reduction": inductor_config.triton.mix_order_reduction}):
        yield


def _run(checkpoint, batches, compile: bool) -> tuple[dict, list[dict], dict, list[int], int]:
    """One micro-batch's gradients on the starting weights, then a train call per batch: (gradients, each call's
    metrics and π_old, the final weights, dynamo's compiled frames before the calls and after each, separate π_old
    passes run)."""
    from torch._dynamo.utils import counters  # noqa: PLC0415

    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from slime_dsa.models import PackedBatch  # noqa: PLC0415
    from trainers.base import OptimizerConfig, policy_config  # noqa: PLC0415
    from trainers.fsdp.worker import FSDPWorker  # noqa: PLC0415
    from trainers.process_group import free_port  # noqa: PLC0415

    # The indexer frozen, as trainers/factory.py freezes it without an indexer loss: a compiled layer carries the
    # indexer's outputs across its graph break, so its backward gives the indexer zero gradients, where the eager
    # layer leaves them None.
    config = policy_config(str(checkpoint), PPOLoss(), OptimizerConfig(learning_rate=1e-3), frozen=(".indexer.",),
                           seed=0, compile=compile, ops_backend="torch", micro_batch_tokens=96)
    worker = FSDPWorker(0, 1, "127.0.0.1", free_port(), config)
    try:
        model = worker.policy.runs
        compiled = [hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in model.model.layers]
        assert compiled == [compile] * len(model.model.layers)
        if compile:  # no graph may branch on the token count: that recompiled in step 1 on an H100 (apply_compile)
            assert torch._inductor.config.triton.mix_order_reduction is False
        first = batches[0]
        logp, _ = model.token_logprobs(first.input_ids, PackedBatch.from_seqlens(first.seqlens))
        (logp * first.advantages * first.loss_mask).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        worker.zero_gradients(worker.policy)
        passes = []  # the separate π_old passes: none, the first step's forward gives π_old
        separate_pass = worker.compute_logprobs
        worker.compute_logprobs = lambda *args, **kw: passes.append(1) or separate_pass(*args, **kw)
        metrics, frames = [], [counters["frames"]["ok"]]
        for batch in batches:  # an RL train call each: the π_old pass (no grad), then one optimizer step
            shard = batch.select(list(range(len(batch.seqlens))))  # its own old_logprobs: the batch is shared
            old, step = worker.train_batches([shard], [(float(batch.loss_mask.sum()), len(batch.seqlens))],
                                             recompute_old_logprobs=True)
            metrics.append({**step[0], "old_logprobs": old[0]})
            frames.append(counters["frames"]["ok"])
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        worker.shutdown()
    return grads, metrics, weights, frames, len(passes)


@pytest.mark.slow
@pytest.mark.parametrize("backend", [
    "aot_eager",
    pytest.param("inductor", marks=pytest.mark.skipif(
        not os.environ.get("SLIME_DSA_COMPILE_TESTS"), reason="inductor's code generation takes ~3 min on 2 cores, "
        "past CI's budget; SLIME_DSA_COMPILE_TESTS=1 runs it (passed 2026-12-06)")),
])
def test_compiled_layers_train_as_eager_layers_do(tmp_path, monkeypatch, backend):
    """Float32 on the CPU, torch ops: the compiled rank's gradients, losses and weights after three steps match the
    eager rank's, and the compile happened (dynamo compiled frames; every layer's forward is a compiled one).

    Not bit for bit: inductor fuses the norms, RoPE and MLP glue into kernels that sum in another order, ~1e-7
    relative per op in float32. Gradients within rtol 1e-4 (atol 1e-6 for entries near 0), losses within 1e-5
    relative, π_old within 1e-5. The weights after three AdamW steps within 1e-4, a tenth
    of lr: AdamW's first steps move a weight by lr times about g / (|g| + eps), so gradients 1e-4 apart move most
    weights ~1e-7 apart, but one whose gradient is near 0 by up to lr times its relative change (one entry in 2048
    came out 1.06e-5 apart); a step the compiled rank took differently moves weights ~lr apart.

    π_old is the first step's own forward in both (no separate pass). The floats the layers read (norm eps,
    routed_scaling_factor) are constants of their graphs, not 0-d tensor inputs: inductor's CUDA code reads such an
    input with .item() at every kernel launch that uses it (on an H100 ~150-250 host syncs a train call against
    eager's 6-12, benchmarks/RESULTS.md), which apply_compile's specialize_float prevents.

    Three train calls of different packs (token counts and numbers of sequences, micro-batches of 96 tokens): the
    layers are compiled with dynamic shapes, so the second and third compile no new frame.

    backend aot_eager (every run) is a stand-in for inductor's code generation (a FAKE of that part only): dynamo's
    tracing, graph breaks, guards and recompiles and AOT autograd's joint graph are real, the kernels eager ops;
    inductor itself with SLIME_DSA_COMPILE_TESTS=1."""
    import functools  # noqa: PLC0415

    from torch._dynamo.utils import counters  # noqa: PLC0415

    from trainers.fsdp import parallelize  # noqa: PLC0415

    recording = _RecordingBackend() if backend == "aot_eager" else None
    monkeypatch.setattr(parallelize.torch, "compile", functools.partial(torch.compile, backend=recording or backend))

    checkpoint = _checkpoint(tmp_path, "tiny", VOCAB)
    # 24-30 tokens > index_topk 16: the indexer selects a real subset
    batches = [_grpo_batch(8, 24, 10, 4, VOCAB), _grpo_batch(6, 30, 8, 2, VOCAB), _grpo_batch(10, 20, 6, 5, VOCAB)]
    torch._dynamo.reset()
    counters.clear()
    eager_grads, eager_metrics, eager_weights, eager_frames, eager_passes = _run(checkpoint, batches, compile=False)
    assert eager_frames == [0, 0, 0, 0]
    grads, metrics, weights, frames, passes = _run(checkpoint, batches, compile=True)
    torch._dynamo.reset()

    # π_old is the first step's forward, compiled too: a separate pass made a compiled RL train call slower than the
    # eager one on an H100 (one more forward, through no-grad graphs of its own)
    assert passes == eager_passes == 0
    if recording is not None:
        assert recording.graph_args > 0, "no compiled graph's inputs were seen"
        assert recording.wrapped_floats == [], (
            f"floats passed to the compiled layers as tensors: {sorted(set(recording.wrapped_floats))}")
    assert frames[1] > 0 and counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    assert frames[1] == frames[2] == frames[3], f"recompiled for new pack shapes: compiled frames by step {frames}"
    # each call reports what it compiled (perf/trainer_compiles); eager calls report nothing
    assert [m.pop("trainer_compiles") for m in metrics] == [b - a for a, b in zip(frames, frames[1:])]
    assert all("trainer_compiles" not in m for m in eager_metrics)
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    for got, want in zip(metrics, eager_metrics):
        assert got.keys() == want.keys()
        torch.testing.assert_close(got.pop("old_logprobs"), want.pop("old_logprobs"), rtol=1e-5, atol=1e-5)
        for key in ("loss", "pg_loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-8), key
    for name, weight in weights.items():
        torch.testing.assert_close(weight, eager_weights[name], rtol=0, atol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("data, says", [
    ({"trainer": {"compile": True, "backend": "megatron"}}, "compile is built for backend 'fsdp' only"),
    ({"trainer": {"compile": True, "backend": "deepspeed"}}, "compile is built for backend 'fsdp' only"),
    ({"trainer": {"compile": True}, "model": {"true_on_policy": True}},
     "model.true_on_policy needs the trainer to run the engines' unfused"),
])
def test_compile_where_it_is_not_built_is_refused(data, says):
    with pytest.raises(RecipeError) as info:
        validate_recipe(data)
    message = str(info.value)
    assert "\n" not in message and says in message


def test_compile_on_the_fsdp_trainer_is_accepted():
    assert validate_recipe({"trainer": {"compile": True}}).trainer.compile


def test_the_one_process_commands_refuse_compile():
    """slime-dsa sft and indexer-warmup run their model eagerly: trainer.compile set is refused, not ignored."""
    from slime_dsa.config.indexer_warmup import NOT_READ_BY_INDEXER_WARMUP  # noqa: PLC0415
    from slime_dsa.config.sft import sft_problems, unread_key_problems  # noqa: PLC0415

    config = validate_recipe({"trainer": {"compile": True}})
    for problems in (sft_problems(config), unread_key_problems(config, NOT_READ_BY_INDEXER_WARMUP)):
        assert [key for key, _ in problems] == ["trainer.compile"]
        assert "runs its model eagerly" in problems[0][1]


class _RecordingBackend:
    """aot_eager, recording each graph's inputs that dynamo made tensors of Python quantities (floats unspecialized
    under dynamic=True: `pass_arg_as_tensor`)."""

    def __init__(self) -> None:
        self.wrapped_floats: list[str] = []
        self.graph_args = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        from torch._dynamo.backends.debugging import aot_eager  # noqa: PLC0415

        for node in gm.graph.find_nodes(op="placeholder"):
            arg = node.meta.get("grapharg")
            self.graph_args += arg is not None
            if arg is not None and arg.pass_arg_as_tensor:
                self.wrapped_floats.append(arg.source.name)
        return aot_eager(gm, example_inputs)


@pytest.mark.slow
def test_the_warmup_compiles_the_pi_old_pass_of_later_mini_batches(tmp_path, monkeypatch):
    """A compiled rank's warm-up runs the π_old pass too: a train call of two mini-batches (the second's π_old from a
    no-grad pass, graphs of its own) then compiles no new frame. Without it those graphs compiled in step 1 (20 s of
    the first RL step on an H100, benchmarks/RESULTS.md). aot_eager stands in for inductor (a FAKE of its code
    generation only: dynamo's tracing and guards are real)."""
    import functools  # noqa: PLC0415

    from torch._dynamo.utils import counters  # noqa: PLC0415

    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from trainers.base import OptimizerConfig, policy_config  # noqa: PLC0415
    from trainers.fsdp import parallelize  # noqa: PLC0415
    from trainers.fsdp.worker import FSDPWorker  # noqa: PLC0415
    from trainers.process_group import free_port  # noqa: PLC0415

    monkeypatch.setattr(parallelize.torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    checkpoint = _checkpoint(tmp_path, "tiny", VOCAB)
    config = policy_config(str(checkpoint), PPOLoss(), OptimizerConfig(learning_rate=1e-3), frozen=(".indexer.",),
                           seed=0, compile=True, ops_backend="torch", micro_batch_tokens=96)
    batch = _grpo_batch(8, 24, 10, 4, VOCAB)
    torch._dynamo.reset()
    counters.clear()
    worker = FSDPWorker(0, 1, "127.0.0.1", free_port(), config)
    try:
        worker.warmup_passes(30)
        warmed = counters["frames"]["ok"]
        shards = [batch.select([0, 1, 2, 3]), batch.select([4, 5, 6, 7])]
        _, metrics = worker.train_batches(shards, [(float(s.loss_mask.sum()), len(s.seqlens)) for s in shards],
                                          recompute_old_logprobs=True)
        assert warmed > 0 and counters["frames"]["ok"] == warmed, (
            f"compiled frames: {warmed} after the warm-up, {counters['frames']['ok']} after a train call")
        assert metrics[0]["trainer_compiles"] == 0
    finally:
        worker.shutdown()
        torch._dynamo.reset()


def test_a_compile_after_the_warmup_is_counted_and_logged(tmp_path, monkeypatch, caplog):
    """A train call reports the graph variants it compiled (trainer_compiles), and after a warm-up that compiled the
    kernels a non-zero count is a warning: compiling in a step is the start-up cost the warm-up exists to move.
    FAKE: torch.compile is the identity and dynamo's frame counter a scripted one (this tests the bookkeeping; the
    tests above compile for real)."""
    import logging  # noqa: PLC0415

    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from trainers import rank as rank_module  # noqa: PLC0415
    from trainers.base import OptimizerConfig, policy_config  # noqa: PLC0415
    from trainers.fsdp import parallelize  # noqa: PLC0415
    from trainers.fsdp.worker import FSDPWorker  # noqa: PLC0415
    from trainers.process_group import free_port  # noqa: PLC0415

    monkeypatch.setattr(parallelize.torch, "compile", lambda fn, **_: fn)
    frames = iter([0, 3, 3, 3])  # the first call compiles 3 frames, the second none
    monkeypatch.setattr(rank_module, "_compiled_frames", lambda: next(frames))
    checkpoint = _checkpoint(tmp_path, "tiny", VOCAB)
    config = policy_config(str(checkpoint), PPOLoss(), OptimizerConfig(learning_rate=1e-3), frozen=(".indexer.",),
                           seed=0, compile=True, ops_backend="torch", micro_batch_tokens=96)
    batch = _grpo_batch(4, 20, 6, 2, VOCAB)
    worker = FSDPWorker(0, 1, "127.0.0.1", free_port(), config)
    try:
        worker._kernels_warmed = True  # as warm_up leaves it on a GPU
        counts = []
        for _ in range(2):
            with caplog.at_level(logging.WARNING, logger="trainers.rank"):
                caplog.clear()
                shard = batch.select(list(range(len(batch.seqlens))))  # its own old_logprobs
                _, metrics = worker.train_batches([shard], [(float(batch.loss_mask.sum()), len(batch.seqlens))],
                                                  recompute_old_logprobs=True)
            counts.append((metrics[0]["trainer_compiles"], [r.getMessage() for r in caplog.records]))
    finally:
        worker.shutdown()
    (first, first_logs), (second, second_logs) = counts
    assert first == 3 and len(first_logs) == 1 and "compiled 3 graph variants in this train call" in first_logs[0]
    assert second == 0 and second_logs == []
