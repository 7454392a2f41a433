"""The largest GLM-MoE-DSA model one GPU trains with FSDP2 (bf16 compute, float32 master weights and AdamW state on
the device) and with DeepSpeed ZeRO-3 + CPU offload (parameters and optimizer in host memory), and the tokens per
second of each.

A size is a number of decoder layers of one family (hidden 2048, 64 routed experts of 768, top-8, ~0.33B parameters a
layer: the parameter count is printed). Each attempt runs in a process of its own (an out-of-memory error leaves
nothing behind), builds the model at random, and times training steps of `--tokens` tokens (sequences of 1024; next-
token log-likelihood, gradient checkpointing on) through the backend's own wrapping: trainers/fsdp/parallelize.py, or
trainers/deepspeed/engine.py. Sizes go up until one fails or `--budget-s` runs out; each result is one JSON line in
`--out`, and a Markdown table closes the run.
    python benchmarks/deepspeed_capacity.py --backend both --layers 8,16,20,24 --out $OUT/capacity.jsonl
    python benchmarks/deepspeed_capacity.py --device cpu --layers 1 --tiny      # a smoke test without a GPU
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

logger = logging.getLogger("deepspeed_capacity")

FAMILY = dict(hidden_size=2048, intermediate_size=5632, moe_intermediate_size=768, num_attention_heads=16,
              q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
              n_routed_experts=64, num_experts_per_tok=8, first_k_dense_replace=1, index_n_heads=32,
              index_head_dim=128, index_topk=512, num_nextn_predict_layers=0)
TINY = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=2, q_lora_rank=32,
            kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
            num_experts_per_tok=2, first_k_dense_replace=1, index_n_heads=4, index_head_dim=16, index_topk=16,
            num_nextn_predict_layers=0)
VOCAB, SEQ = 32000, 1024


def model_config(layers: int, tiny: bool):
    from slime_dsa.models.presets import preset_config  # noqa: PLC0415

    family = TINY if tiny else FAMILY
    types = ["full", "shared", "shared", "shared"] * (layers // 4 + 1)
    return preset_config("small", vocab_size=VOCAB, **family, num_hidden_layers=layers, indexer_types=types[:layers])


def build(backend: str, config, device):
    """(model the step enters, a function that backpropagates and updates): FSDP2 or ZeRO-3 + CPU offload."""
    import torch  # noqa: PLC0415

    from slime_dsa.models.glm_moe_dsa import GlmMoeDsaForCausalLM, Router  # noqa: PLC0415
    from trainers.base import OptimizerConfig, RoleConfig  # noqa: PLC0415

    role = RoleConfig("", OptimizerConfig(learning_rate=1e-5, max_grad_norm=1.0), loss=object())
    bf16 = device.type == "cuda"
    if backend == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

        from trainers.fsdp.parallelize import apply_fsdp  # noqa: PLC0415
        from trainers.optim import build_role_optimizer  # noqa: PLC0415

        with torch.device("meta"):
            model = GlmMoeDsaForCausalLM(config)
        model.to_empty(device=device)
        model.init_weights()
        model.gradient_checkpointing = True
        model = apply_fsdp(model, init_device_mesh(device.type, (1,)), bf16, ("token_logprobs",))
        optimizer = build_role_optimizer(model, role.optimizer)

        def update(loss):
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return model, update
    import deepspeed  # noqa: PLC0415

    from trainers.deepspeed.config import DeepSpeedOptions, deepspeed_config  # noqa: PLC0415
    from trainers.deepspeed.engine import EngineModel, build_engine  # noqa: PLC0415

    options = DeepSpeedOptions(zero_stage=3, offload_optimizer="cpu", offload_param="cpu")
    ds_config = deepspeed_config(options, 1.0, bf16, pin_memory=bf16)

    def load(_device):
        # Partitioned (into host memory) as each module is built: the whole model never exists at once.
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = GlmMoeDsaForCausalLM(config)
        for module in model.modules():  # built as zeros: every token would pick the same experts
            if isinstance(module, Router):
                with deepspeed.zero.GatheredParameters([module.weight], modifier_rank=0), torch.no_grad():
                    module.weight.normal_(0.0, config.initializer_range)
        model.gradient_checkpointing = True
        return model

    built = build_engine(load, role, ds_config, options, device)
    model = EngineModel(built.engine)

    def update(loss):
        built.engine.backward(loss)
        built.engine.step()

    return model, update


def attempt(backend: str, layers: int, tokens: int, steps: int, device_name: str, tiny: bool) -> dict:
    """One size on one backend, in this process: parameters, tokens/s over the timed steps, peak device memory."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from slime_dsa import ops  # noqa: PLC0415
    from slime_dsa.models import PackedBatch  # noqa: PLC0415

    device = torch.device(device_name)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29571"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    if device.type == "cpu":
        from trainers.deepspeed.engine import skip_shared_memory_comm_op  # noqa: PLC0415

        skip_shared_memory_comm_op()
    ops.set_backend("auto")
    config = model_config(layers, tiny)
    with torch.device("meta"):
        from slime_dsa.models.glm_moe_dsa import GlmMoeDsaForCausalLM  # noqa: PLC0415

        params = sum(p.numel() for p in GlmMoeDsaForCausalLM(config).parameters())
    start = time.perf_counter()
    model, update = build(backend, config, device)
    built_s = time.perf_counter() - start
    seq = min(SEQ, tokens)
    batch = PackedBatch.from_seqlens([seq] * (tokens // seq), device)
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps + 1):  # the first step warms up (allocations, kernels, DeepSpeed's optimizer state)
        ids = torch.randint(0, VOCAB, (seq * (tokens // seq),), generator=g).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        logp, _ = model.token_logprobs(ids, batch)
        update(-logp.mean())
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    timed = times[1:]
    return {"backend": backend, "layers": layers, "params_b": params / 1e9, "ok": True,
            "tokens_per_s": len(ids) * len(timed) / sum(timed), "step_s": sum(timed) / len(timed),
            "build_s": built_s, "peak_gpu_gib": peak}


def search(args) -> list[dict]:
    """Every backend's sizes in increasing order, each in a fresh process, up to the first failure."""
    results, deadline = [], time.monotonic() + args.budget_s
    for backend in (["fsdp", "deepspeed"] if args.backend == "both" else [args.backend]):
        for layers in sorted(int(x) for x in args.layers.split(",")):
            left = deadline - time.monotonic()
            if left < 30:
                logger.warning("budget spent: %s from %d layers not tried", backend, layers)
                break
            cmd = [sys.executable, __file__, "--one", backend, "--layers", str(layers), "--tokens", str(args.tokens),
                   "--steps", str(args.steps), "--device", args.device] + (["--tiny"] if args.tiny else [])
            try:
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=min(left, args.attempt_s))
                lines = [x for x in run.stdout.splitlines() if x.startswith("{")]
                result = json.loads(lines[-1]) if run.returncode == 0 and lines else {
                    "backend": backend, "layers": layers, "ok": False,
                    "error": (run.stderr.strip().splitlines() or ["exit %d" % run.returncode])[-1][:300]}
            except subprocess.TimeoutExpired:
                result = {"backend": backend, "layers": layers, "ok": False, "error": "timed out"}
            logger.info("%s", json.dumps(result))
            results.append(result)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(result) + "\n")
            if not result["ok"]:
                break
    return results


def table(results: list[dict]) -> str:
    rows = ["| backend | layers | parameters | fits | tokens/s | step s | peak GPU GiB |", "|---|---|---|---|---|---|---|"]
    for r in results:
        if r["ok"]:
            rows.append(f"| {r['backend']} | {r['layers']} | {r['params_b']:.2f}B | yes | {r['tokens_per_s']:.0f} | "
                        f"{r['step_s']:.2f} | {r['peak_gpu_gib']:.1f} |")
        else:
            rows.append(f"| {r['backend']} | {r['layers']} | | no: {r['error']} | | | |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["fsdp", "deepspeed", "both"], default="both")
    parser.add_argument("--layers", default="4,8,12,16,20,24", help="decoder layer counts to try, comma-separated")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per training step")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per attempt (after one warm-up step)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model family (smoke test)")
    parser.add_argument("--budget-s", type=float, default=540, help="wall-clock budget of the whole search")
    parser.add_argument("--attempt-s", type=float, default=300, help="wall-clock limit of one attempt")
    parser.add_argument("--out", help="JSON lines file the results are appended to")
    parser.add_argument("--one", choices=["fsdp", "deepspeed"], help=argparse.SUPPRESS)  # a single attempt
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.one:
        print(json.dumps(attempt(args.one, int(args.layers), args.tokens, args.steps, args.device, args.tiny)))
        return
    logger.info("%s", table(search(args)))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
