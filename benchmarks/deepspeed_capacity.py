"""The largest GLM-MoE-DSA model one GPU trains with FSDP2 (bf16 compute, float32 master weights and AdamW state on
the device) and with DeepSpeed ZeRO-3 + CPU offload (float32 master weights, gradients and AdamW state in host
memory; with --offload-param the bf16 weights too), and the tokens per second of each.

A size is a number of decoder layers of one family (hidden 2048, 64 routed experts of 768, top-8, ~0.32B parameters a
layer: the parameter count is printed). Each attempt runs in a process of its own (an out-of-memory error leaves
nothing behind), builds the model at random, and times training steps of `--tokens` tokens (sequences of 1024; next-
token log-likelihood, gradient checkpointing on) through the backend's own wrapping: trainers/fsdp/parallelize.py, or
trainers/deepspeed/engine.py. Sizes go up until one fails or `--budget-s` runs out; each result is one JSON line
(logged, and appended to `--out`), and a Markdown table closes the run.

`--layers auto` (the default) plans from the machine: FSDP2 tries the largest size whose 16 bytes a parameter fit
the GPU's memory, then one and two layers more (it stops at the first that fails); DeepSpeed tries once, the largest
size whose 16 (18 with --offload-param) bytes a parameter fit 80% of the free host memory. A host out-of-memory kill
costs a minute and risks the machine, so DeepSpeed's figure is a size that fits, not a bracket.
    python benchmarks/deepspeed_capacity.py --backend both --out $OUT/capacity.jsonl
    python benchmarks/deepspeed_capacity.py --device cpu --layers 1,2 --tiny --budget-s 300    # a smoke test, no GPU
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

from trainers.process_group import free_port

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


def build(backend: str, config, device, offload_param: bool):
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

    options = DeepSpeedOptions(zero_stage=3, offload_optimizer="cpu", offload_param="cpu" if offload_param else "none")
    ds_config = deepspeed_config(options, 1.0, bf16, pin_memory=bf16)

    def load(_device):
        # Partitioned as each module is built (into host memory with offload_param): never whole in float32.
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


def attempt(backend: str, layers: int, tokens: int, steps: int, device_name: str, tiny: bool,
            offload_param: bool) -> dict:
    """One size on one backend, in this process: parameters, tokens/s over the timed steps, peak device and host
    memory."""
    import resource  # noqa: PLC0415

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
    start = time.perf_counter()
    model, update = build(backend, config, device, offload_param)
    built_s = time.perf_counter() - start
    logger.info("%s, %d layers: built in %.1f s", backend, layers, built_s)  # on stderr: a timed-out attempt's progress
    seq = min(SEQ, tokens)
    batch = PackedBatch.from_seqlens([seq] * (tokens // seq), device)
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps + 1):  # the first step warms up (allocations, kernels, the optimizer's state)
        ids = torch.randint(0, VOCAB, (seq * (tokens // seq),), generator=g).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        logp, _ = model.token_logprobs(ids, batch)
        update(-logp.mean())
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        logger.info("%s, %d layers: step %d in %.1f s", backend, layers, len(times), times[-1])
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    timed = times[1:]
    return {"backend": backend, "layers": layers, "params_b": num_params(layers, tiny) / 1e9, "ok": True,
            "offload_param": offload_param if backend == "deepspeed" else None,
            "tokens_per_s": len(ids) * len(timed) / sum(timed), "step_s": sum(timed) / len(timed),
            "first_step_s": times[0], "build_s": built_s, "peak_gpu_gib": peak,
            "peak_host_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def num_params(layers: int, tiny: bool) -> int:
    """Parameters of the family at `layers` decoder layers (counted on the meta device)."""
    import torch  # noqa: PLC0415

    from slime_dsa.models.glm_moe_dsa import GlmMoeDsaForCausalLM  # noqa: PLC0415

    with torch.device("meta"):
        return sum(p.numel() for p in GlmMoeDsaForCausalLM(model_config(layers, tiny)).parameters())


def gpu_bytes() -> int:
    """The first visible GPU's memory, asked in a child process (torch here would hold a CUDA context through every
    attempt)."""
    code = "import torch; print(torch.cuda.mem_get_info()[1])"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def host_bytes() -> int:
    """Free host memory: MemAvailable, or what the cgroup's limit leaves if that is lower (a container's share)."""
    with open("/proc/meminfo") as f:
        free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit, usage = (Path(limit_file).read_text().strip(), int(Path(usage_file).read_text()))
        except (OSError, ValueError):
            continue
        if limit.isdigit():
            free = min(free, int(limit) - usage)
        break
    return free


def plan(backend: str, tiny: bool, offload_param: bool) -> list[int]:
    """Layer counts to try (see the module docstring): from the GPU's memory for FSDP2, the host's for DeepSpeed."""
    first, second = num_params(1, tiny), num_params(2, tiny)

    def largest(budget: float, bytes_per_param: int) -> int:
        return max(1, 1 + int((budget / bytes_per_param - first) // (second - first)))

    if backend == "fsdp":
        fit = largest(gpu_bytes() - 10 * 2**30, 16)  # 10 GiB: activations, a gathered layer, the allocator's slack
        return [fit, fit + 1, fit + 2]
    return [largest(0.8 * host_bytes() - 8 * 2**30, 18 if offload_param else 16)]


def search(args) -> list[dict]:
    """Every backend's sizes in increasing order, each in a fresh process, up to the first failure (after a failure
    before any size fitted, one layer less). DeepSpeed goes first: its attempt is the longest."""
    results, deadline = [], time.monotonic() + args.budget_s
    for backend in (["deepspeed", "fsdp"] if args.backend == "both" else [args.backend]):
        if args.layers == "auto":
            sizes = plan(backend, args.tiny, args.offload_param)
        else:
            sizes = sorted(int(x) for x in args.layers.split(","))
        logger.info("%s: trying %s decoder layers", backend, sizes)
        fitted = False
        while sizes:
            layers = sizes.pop(0)
            left = deadline - time.monotonic()
            if left < 30:
                logger.warning("budget spent: %s from %d layers not tried", backend, layers)
                break
            cmd = [sys.executable, __file__, "--one", backend, "--layers", str(layers), "--tokens", str(args.tokens),
                   "--steps", str(args.steps), "--device", args.device] + (["--tiny"] if args.tiny else []) + (
                   ["--offload-param"] if args.offload_param else [])
            env = {**os.environ, "MASTER_PORT": str(free_port())}
            try:
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=min(left, args.attempt_s), env=env)
                lines = [x for x in run.stdout.splitlines() if x.startswith("{")]
                result = json.loads(lines[-1]) if run.returncode == 0 and lines else {
                    "backend": backend, "layers": layers, "ok": False, "error": _error(run)}
            except subprocess.TimeoutExpired as e:
                err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
                progress = [x for x in err.splitlines() if " layers: " in x]
                result = {"backend": backend, "layers": layers, "ok": False,
                          "error": "timed out" + (f" after '{progress[-1]}'" if progress else "")}
            result.setdefault("params_b", num_params(layers, args.tiny) / 1e9)
            logger.info("%s", json.dumps(result))
            results.append(result)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(result) + "\n")
            fitted = fitted or result["ok"]
            if not result["ok"]:
                sizes = [layers - 1] if not fitted and layers > 1 and backend == "fsdp" else []
    return results


def _error(run: subprocess.CompletedProcess) -> str:
    """The line that says why an attempt failed: an out-of-memory error's, else the last line of stderr."""
    lines = run.stderr.strip().splitlines()
    if run.returncode in (-9, 137):
        return "killed (host out of memory?)"
    oom = [x for x in lines if "OutOfMemoryError" in x or "out of memory" in x.lower()]
    return ((oom or lines or [f"exit {run.returncode}"])[-1])[:300]


def table(results: list[dict]) -> str:
    rows = ["| backend | layers | parameters | fits | tokens/s | step s | peak GPU GiB | peak host GiB |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r["ok"]:
            rows.append(f"| {r['backend']} | {r['layers']} | {r['params_b']:.2f}B | yes | {r['tokens_per_s']:.0f} | "
                        f"{r['step_s']:.2f} | {r['peak_gpu_gib']:.1f} | {r['peak_host_gib']:.1f} |")
        else:
            rows.append(f"| {r['backend']} | {r['layers']} | {r['params_b']:.2f}B | no: {r['error']} | | | | |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["fsdp", "deepspeed", "both"], default="both")
    parser.add_argument("--layers", default="auto", help="decoder layer counts to try, comma-separated, or auto")
    parser.add_argument("--offload-param", action="store_true", help="DeepSpeed: the bf16 weights in host memory too")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per training step")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per attempt (after one warm-up step)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model family (smoke test)")
    parser.add_argument("--budget-s", type=float, default=170, help="wall-clock budget of the whole search")
    parser.add_argument("--attempt-s", type=float, default=120, help="wall-clock limit of one attempt")
    parser.add_argument("--out", help="JSON lines file the results are appended to")
    parser.add_argument("--one", choices=["fsdp", "deepspeed"], help=argparse.SUPPRESS)  # a single attempt
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.one:
        print(json.dumps(attempt(args.one, int(args.layers), args.tokens, args.steps, args.device, args.tiny,
                                 args.offload_param)))
        return
    if args.layers == "auto" and args.device != "cuda":
        parser.error("--layers auto plans from a GPU's memory: give --layers on a CPU")
    logger.info("%s", table(search(args)))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
