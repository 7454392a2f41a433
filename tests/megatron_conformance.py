"""Rank bodies of the Megatron conformance tests (spawned processes, gloo): the same 5 batches through FSDP2 or
Megatron ranks, recording each step's metrics, the log-probs before it, and every gradient after the first step."""

from __future__ import annotations

import json
from pathlib import Path

import torch

STEPS, NUM_SAMPLES = 5, 6


def batches(vocab_size: int, count: int = STEPS, seed: int = 0):
    """STEPS packed batches of NUM_SAMPLES samples (prompt 5, responses of 4-7 tokens), advantages of both signs."""
    from trainers.base import TrainBatch  # noqa: PLC0415

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids, mask, adv, lens = [], [], [], []
        for s in range(NUM_SAMPLES):
            response = 4 + s % 4
            ids += torch.randint(0, vocab_size, (5 + response,), generator=g).tolist()
            mask += [0.0] * 5 + [1.0] * response
            adv += [0.0] * 5 + [1.0 if s % 3 else -1.0] * response
            lens.append(5 + response)
        n = len(ids)
        out.append(TrainBatch(input_ids=torch.tensor(ids), seqlens=lens, loss_mask=torch.tensor(mask),
                              rollout_logprobs=torch.full((n,), -2.0), advantages=torch.tensor(adv)))
    return out


def rank_config(checkpoint: str, backend_options: dict, mixed_precision: bool = False, lr: float = 1e-3,
                indexer_loss_coef: float = 1.0, ops_backend: str = "auto"):
    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from trainers.base import DSAOptions, OptimizerConfig, policy_config  # noqa: PLC0415

    dsa = DSAOptions(indexer_loss_coef=indexer_loss_coef, indexer_stage="sparse", indexer_target="group")
    return policy_config(checkpoint, PPOLoss(), OptimizerConfig(learning_rate=lr, max_grad_norm=1e6), dsa=dsa,
                         ops_backend=ops_backend, data_parallel="fsdp", backend_options=backend_options,
                         mixed_precision=mixed_precision, micro_batch_tokens=32, seed=0)


def gradients(worker) -> dict[str, torch.Tensor]:
    """HF name -> the whole gradient of every parameter (collective: FSDP gathers shards, Megatron TP/EP parts)."""
    model = worker.policy.model
    if hasattr(model, "output_layer"):  # a Megatron model
        from trainers.megatron.weights import gather_hf, local_grads  # noqa: PLC0415

        return gather_hf(local_grads(model), model.config)
    out = {}
    for name, p in model.named_parameters():
        grad = torch.zeros_like(p) if p.grad is None else p.grad
        out[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().float().cpu()
    return out


def train(rank: int, world_size: int, port: int, backend: str, checkpoint: str, options: dict, out: str,
          mixed_precision: bool = False) -> None:
    """One rank: STEPS optimiser steps, each on its data-parallel share of the batch (π_old recomputed first)."""
    torch.set_num_threads(1)
    config = rank_config(checkpoint, options, mixed_precision)
    if backend == "megatron":
        from trainers.megatron.worker import MegatronWorker as Worker  # noqa: PLC0415
    else:
        from trainers.fsdp.worker import FSDPWorker as Worker  # noqa: PLC0415
    worker = Worker(rank, world_size, "127.0.0.1", port, config)
    vocab = json.loads((Path(checkpoint) / "config.json").read_text())["vocab_size"]
    dp_rank, dp_size = worker.data_parallel_layout()
    share = [i for i in range(NUM_SAMPLES) if i % dp_size == dp_rank]
    shares = [b.select(share) for b in batches(vocab)]
    for mine in shares:  # π_old is the starting policy for every step, so the loss moves with the weights
        mine.old_logprobs = worker.compute_logprobs(mine)
    record = {"steps": [], "logprobs": [], "share": share}
    for step, (batch, mine) in enumerate(zip(batches(vocab), shares)):
        record["logprobs"].append(worker.compute_logprobs(mine).tolist())  # rank 0's share under this step's weights
        record["steps"].append(worker.train_step(mine, float(batch.loss_mask.sum()), NUM_SAMPLES))
        if step == 0:
            grads = gradients(worker)
            if rank == 0:
                from safetensors.torch import save_file  # noqa: PLC0415

                save_file(grads, f"{out}.grads.safetensors")
    if rank == 0:
        Path(out).write_text(json.dumps(record))
    worker.shutdown()


def recompute(rank: int, world_size: int, port: int, checkpoint: str, options: dict, out: str) -> None:
    """One rank: the gradients of one step without, then with activation recomputation (learning rate 0, so the
    weights stay put), and how many decoder-layer forwards each ran. The indexer loss is off: its capture, as in
    FSDP2, keeps every layer's activations, so recomputation would not run."""
    torch.set_num_threads(1)
    from trainers.megatron.worker import MegatronWorker  # noqa: PLC0415

    worker = MegatronWorker(rank, world_size, "127.0.0.1", port,
                            rank_config(checkpoint, options, lr=0.0, indexer_loss_coef=0.0))
    model, calls = worker.policy.model, [0]
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    vocab = json.loads((Path(checkpoint) / "config.json").read_text())["vocab_size"]
    dp_rank, dp_size = worker.data_parallel_layout()
    batch = batches(vocab, count=1)[0]
    mine = batch.select([i for i in range(NUM_SAMPLES) if i % dp_size == dp_rank])
    mine.old_logprobs = worker.compute_logprobs(mine)
    record = {}
    for flag in (False, True):
        model.gradient_checkpointing, calls[0] = flag, 0
        norm = worker.train_step(mine, float(batch.loss_mask.sum()), NUM_SAMPLES)["grad_norm"]
        grads = gradients(worker)
        record[str(flag)] = {"grad_norm": norm, "layer_forwards": calls[0]}
        if rank == 0:
            from safetensors.torch import save_file  # noqa: PLC0415

            save_file(grads, f"{out}.{flag}.safetensors")
    if rank == 0:
        Path(out).write_text(json.dumps(record))
    worker.shutdown()


def resume(rank: int, world_size: int, port: int, checkpoint: str, out: str, phase: str, cuda_on_cpu: bool) -> None:
    """One rank of Megatron in bf16 (megatron's DistributedOptimizer). phase "first": 2 steps, checkpoint step2/, step 3,
    checkpoint step3_first/. "resumed" (a fresh process): load step2/, write it back as loaded/, step 3, checkpoint
    step3_resumed/. Reference DSA ops and, on a GPU, deterministic kernels: equal state gives equal bits.
    cuda_on_cpu: the DistributedOptimizer on CPU ranks (distributed_optimizer_on_cpu)."""
    import os  # noqa: PLC0415

    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    torch.set_num_threads(1)
    if torch.cuda.is_available():  # scatter-adds in backward (embedding, gathers, MoE permutes) in a fixed order
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = False
    if cuda_on_cpu:
        Worker = distributed_optimizer_on_cpu()
    else:
        from trainers.megatron.worker import MegatronWorker as Worker  # noqa: PLC0415
    worker = Worker(rank, world_size, "127.0.0.1", port,
                    rank_config(checkpoint, {}, mixed_precision=True, ops_backend="torch"))
    assert worker.distributed_optimizer
    vocab = json.loads((Path(checkpoint) / "config.json").read_text())["vocab_size"]
    dp_rank, dp_size = worker.data_parallel_layout()
    share = [i for i in range(NUM_SAMPLES) if i % dp_size == dp_rank]
    steps = [(b, b.select(share)) for b in batches(vocab, count=3)]
    old = Path(out) / f"old_logprobs_rank{rank}.safetensors"  # π_old of each step at the start, from the first run
    if phase == "first":
        save_file({str(i): worker.compute_logprobs(mine) for i, (_, mine) in enumerate(steps)}, old)
    for i, logp in load_file(old).items():
        steps[int(i)][1].old_logprobs = logp
    for name in ("step2", "loaded", f"step3_{phase}"):
        (Path(out) / name).mkdir(exist_ok=True)
    if phase == "first":
        for batch, mine in steps[:2]:
            worker.train_step(mine, float(batch.loss_mask.sum()), NUM_SAMPLES)
        worker.save_checkpoint(f"{out}/step2")
    else:
        worker.load_checkpoint(f"{out}/step2")
        worker.save_checkpoint(f"{out}/loaded")
    batch, mine = steps[2]
    record = worker.train_step(mine, float(batch.loss_mask.sum()), NUM_SAMPLES)
    worker.save_checkpoint(f"{out}/step3_{phase}")
    if rank == 0:
        Path(out, f"step3_{phase}.json").write_text(json.dumps(record))
    worker.shutdown()


def distributed_optimizer_on_cpu():
    """MegatronWorker with megatron's DistributedOptimizer on CPU ranks, for tests only (the worker uses it on GPUs
    alone): on top of trainers.megatron.cpu_shim, the optimizer's few CUDA-only spots are pretended. It tells bf16 from
    float32 parameters by type strings ("torch.cuda.BFloat16Tensor") and allocates its flags (found-inf, the norm) on
    device "cuda"; neither changes what it computes. Patches this process's torch: call it in a spawned rank."""
    from trainers.megatron import cpu_shim  # noqa: PLC0415
    from trainers.megatron.worker import MegatronWorker  # noqa: PLC0415

    type_string = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        out = type_string(self, *args, **kwargs)
        return out.replace("torch.", "torch.cuda.", 1) if not args and not kwargs and isinstance(out, str) else out

    def on_cpu(factory):
        def make(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)
        return make

    cpu_shim.apply()
    torch.Tensor.type = cuda_type
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    for name in ("tensor", "zeros", "empty", "ones", "full"):
        setattr(torch, name, on_cpu(getattr(torch, name)))

    class DistributedOptimizerWorker(MegatronWorker):
        def _build_role(self, name, config):
            self.distributed_optimizer, self.dtype = True, torch.bfloat16  # as on a GPU with mixed_precision
            return super()._build_role(name, config)

    return DistributedOptimizerWorker


# A GLM-MoE-DSA in which bf16 rounding differences show: 4 layers, 16 experts of which 4 per token, top-64 of 128 keys.
BF16_SHAPE = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                  v_head_dim=32, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
                  first_k_dense_replace=1, index_n_heads=8, index_head_dim=32, index_topk=64,
                  indexer_types=["full", "shared"] * 2, vocab_size=2048)
BF16_SEQLENS = [128, 128, 96]


# Tensors transformers holds in float32 in a bf16 model (the router) or that we hold so (the indexer head).
FLOAT32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")


def save_bf16_checkpoint(directory: str, float32_router: bool = False) -> None:
    """A bf16 checkpoint (as benchmarks/megatron_vs_fsdp.py writes for the GPU) with a non-zero selection bias.
    float32_router False: every value bf16-exact, so every loader holds the same values and only how each computes
    can differ. True: the router weight, its bias and the indexer head float32 values that bf16 cannot hold (as a
    checkpoint saved from float32 training holds them); a loader that rounds them anywhere differs."""
    from slime_dsa.checkpoint.hf_format import build_model, save_pretrained  # noqa: PLC0415
    from slime_dsa.models.glm_moe_dsa import Router  # noqa: PLC0415
    from slime_dsa.models.presets import preset_config  # noqa: PLC0415

    model = build_model(preset_config("tiny", **BF16_SHAPE), seed=0, dtype=torch.float32)
    with torch.no_grad():
        for router in (m for m in model.modules() if isinstance(m, Router)):
            router.e_score_correction_bias.normal_(0, 0.1)
    state = {}
    for name, t in model.state_dict().items():
        if not name.endswith(FLOAT32_SUFFIXES):
            state[name] = t.bfloat16()
        else:
            state[name] = t if float32_router else t.bfloat16().float()
    save_pretrained(model, directory, state_dict=state)


def float32_tensors(checkpoint: str) -> dict[str, torch.Tensor]:
    """The checkpoint's router weights, selection biases and indexer heads (FLOAT32_SUFFIXES)."""
    from slime_dsa.checkpoint.hf_format import read_state_dict  # noqa: PLC0415

    return {k: v for k, v in read_state_dict(checkpoint).items() if k.endswith(FLOAT32_SUFFIXES)}


def bf16_logprobs(rank: int, port: int, checkpoint: str, out: str) -> None:
    """One process: log-probs of the same batch, at the same weights, from Megatron in bf16 (as its GPU ranks build
    it), FSDP2 with bf16 mixed precision (as its GPU ranks wrap it), the bf16 compute copy of one mixed-precision rank
    (Bf16Compute), the engine's bf16 model, and float32; on the GPU when there is one (nccl, Triton kernels), else on
    the CPU (gloo, torch reference ops). Also whether Megatron holds FLOAT32_SUFFIXES tensors as the file does."""
    import os  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415

    from slime_dsa.checkpoint.hf_format import load_model  # noqa: PLC0415
    from slime_dsa.models.glm_moe_dsa import PackedBatch  # noqa: PLC0415
    from trainers.fsdp.bf16_compute import Bf16Compute  # noqa: PLC0415
    from trainers.fsdp.parallelize import apply_fsdp  # noqa: PLC0415
    from trainers.fsdp.worker import ENTRY_POINTS  # noqa: PLC0415
    from trainers.megatron import cpu_shim  # noqa: PLC0415
    from trainers.megatron.weights import gather_hf_state  # noqa: PLC0415
    from trainers.megatron.parallel import initialize, parallel_sizes  # noqa: PLC0415
    from trainers.megatron.worker import load_model as load_megatron  # noqa: PLC0415

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    cpu_shim.apply()  # a no-op on a GPU machine
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=1)
    sizes = parallel_sizes({})
    groups, place = initialize(sizes)
    if cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: PLC0415

        model_parallel_cuda_manual_seed(0)
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (1,))
    ids = torch.randint(0, BF16_SHAPE["vocab_size"], (sum(BF16_SEQLENS),), generator=torch.Generator().manual_seed(0))
    ids, batch = ids.to(device), PackedBatch.from_seqlens(BF16_SEQLENS, device)
    models = {
        "megatron": lambda: load_megatron(checkpoint, sizes, groups, place, torch.bfloat16, device),
        "fsdp": lambda: apply_fsdp(load_model(checkpoint, dtype=torch.float32, device=device), mesh, True,
                                   ENTRY_POINTS["policy"]),
        "bf16_compute": lambda: Bf16Compute(load_model(checkpoint, dtype=torch.float32, device=device)).module,
        "engine": lambda: load_model(checkpoint, dtype=torch.bfloat16, device=device),
        "float32": lambda: load_model(checkpoint, dtype=torch.float32, device=device),
    }
    record = {}
    for name, build in models.items():
        with torch.no_grad():
            model = build()
            record[name] = model.eval().token_logprobs(ids, batch)[0].float().cpu().tolist()
            if name == "megatron":
                held = gather_hf_state(model, model.config)
                record["megatron_float32_as_file"] = [k for k, v in float32_tensors(checkpoint).items()
                                                      if not torch.equal(held[k], v.float())]
    Path(out).write_text(json.dumps(record))
    dist.destroy_process_group()
