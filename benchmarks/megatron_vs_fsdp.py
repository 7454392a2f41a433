"""Megatron (TP=1) against FSDP2 on one device, same GLM-MoE-DSA checkpoint and batches: bf16 conformance over 5
steps (loss, grad norm, log-probs before each step) and training throughput (tokens/s, MFU).

Each backend runs in its own process (one rank): the 5 conformance steps (short: 4 sequences a step), then warm-up
and timed steps on larger batches, then with --profile-dir one more step under torch.profiler. FSDP2 and Megatron run
first, so the throughput verdict lands before the noise floor, the float32 reference and the layerwise pass. Each
phase's figures reach the JSON as soon as it ends: a process records what it finished before a failure or the time
cap's SIGTERM, and the failure instead of the rest, so one GPU call always reports.
    python benchmarks/megatron_vs_fsdp.py --out result.json                     # H200: the 1.1B model, bf16
    python benchmarks/megatron_vs_fsdp.py --size tiny --device cpu --out r.json # CPU dry run (float32)

--profile-dir DIR: one train step of FSDP2 and of Megatron under torch.profiler (after the timed steps, not timed with
them); DIR/megatron_vs_fsdp_profile.txt gets each one's key_averages, top 25 by device time and by CPU time, the JSON
a summary (kernel time against the step's wall time, host syncs, launches) and the log the ops whose time differs
most between the two: where Megatron's step spends what FSDP2's does not.

Two verdicts on the bf16 conformance, both in the JSON and the log:
- against FSDP2 (`conformance`): the backend `fsdp_split` is FSDP2 again with half the micro-batch tokens, the same
  model and batches split into more forward/backward passes, so only shapes and reduction orders change. Its
  distance from `fsdp` is the bf16 noise floor; Megatron conforms when each figure (the log-probs' at each step) is
  within TOLERANCE or within NOISE_FACTOR x the same figure of that floor. A floor of 0 (step 1: equal weights,
  and FSDP2's split is batch-invariant there) leaves only TOLERANCE.
- against float32 (`conformance_float32`): the backend `fsdp_f32` is FSDP2 in float32 (no mixed precision; the DSA
  ops' torch reference, in float32, not the Triton kernels: their float32 dots would be TF32) on the same batches. At each step, for the loss, the grad norm and the mean
  log-prob, Megatron's distance from it must be within NOISE_FACTOR x FSDP2 bf16's distance from it (or within
  TOLERANCE): Megatron's bf16 is as close to the exact computation as FSDP2's bf16.
  Why a second rule: the split's floor is 0 wherever nothing differs but one path's rounding (step 1), so there any
  rounding difference fails it, and in this random-init MoE one rounding difference flips expert choices that grow
  layer by layer. Measured on CPU in bf16 at equal weights (`benchmarks/megatron_layerwise.py --grouped`, the
  1.1B size, 512 tokens): Megatron with megatron's own top-k normalisation put back (routing weights 1 float32 ulp
  apart, nothing else) is 0.024 from FSDP2 in mean |Δlogp| (experts flip for 0.2% of tokens from layer 3, 8-10% by
  layers 10-11); each is ~0.065 from float32 (FSDP2 0.069, that Megatron 0.063; FSDP2's choices differ from
  float32's for 3% of tokens at layer 1, 23% at layer 11). So two bf16 paths that round differently are NOT further
  from each other than from float32: they are closer (0.024 vs 0.065), and each one's own distance from float32 is
  the scale of bf16's error here. A real error (a wrong weight, a wrong routing) moves Megatron away from float32
  by more than FSDP2 is; a rounding difference leaves it about as close. The existing constants are unchanged;
  this is an added criterion.

MFU is slime_dsa.models.flops' definition, the same for both backends and for the other benchmarks: 6 x the active
parameters per token (routed experts at top-k of n, no embedding; attention scores not counted) x tokens/s, over the
GPU's dense bf16 peak.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch

from trainers.process_group import free_port

logger = logging.getLogger("megatron_vs_fsdp")
STEPS = 5
# Tolerances of the bf16 conformance (FSDP2 and Megatron both keep float32 master weights and compute in bf16). Both
# round as the engine does, so at equal weights (step 1) they agree but for the GPU kernels each picks. In this
# random-init MoE a single bf16 rounding difference flips expert choices, which grow layer by layer: two bf16 paths
# that round differently anywhere differ by ~5e-2 at 1024 tokens (each is ~0.12 from float32; CPU, 1.1B size).
TOLERANCE = {"loss_abs": 2e-2, "grad_norm_rel": 5e-2, "logprob_mean_abs": 2e-2}
NOISE_FACTOR = 1.5
SIZES = {
    # 1.11B parameters (0.34B active): 12 layers, 32 routed experts of which 4 per token, IndexShare every 2 layers.
    "1b": dict(hidden_size=1536, intermediate_size=4096, moe_intermediate_size=512, num_hidden_layers=12,
               num_attention_heads=16, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
               v_head_dim=128, n_routed_experts=32, num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1,
               index_n_heads=32, index_head_dim=128, index_topk=512, indexer_types=["full", "shared"] * 6,
               vocab_size=32768),
    "tiny": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                 v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                 index_n_heads=4, index_head_dim=16, index_topk=16, indexer_types=["full", "shared"], vocab_size=96),
}


def make_batch(vocab: int, samples: int, length: int, seed: int):
    """`samples` packed sequences of `length` tokens (prompt a quarter of them); advantage -1 on every fourth sample,
    +1 on the rest (so the policy loss is far from 0 and its difference means something)."""
    from trainers.base import TrainBatch  # noqa: PLC0415

    g = torch.Generator().manual_seed(seed)
    prompt = length // 4
    mask = ([0.0] * prompt + [1.0] * (length - prompt)) * samples
    adv = sum(([0.0] * prompt + [-1.0 if s % 4 == 3 else 1.0] * (length - prompt) for s in range(samples)), [])
    n = samples * length
    return TrainBatch(input_ids=torch.randint(0, vocab, (n,), generator=g), seqlens=[length] * samples,
                      loss_mask=torch.tensor(mask), rollout_logprobs=torch.full((n,), -2.0),
                      advantages=torch.tensor(adv))


def rank_body(rank: int, backend: str, checkpoint: str, port: int, args: dict, out: str) -> None:
    """One rank of one backend: conformance steps, timed steps, a profiled step; its record is written to `out` after
    each, so a process stopped early leaves what it finished."""
    record: dict = {"backend": backend}

    def save() -> None:
        Path(out).write_text(json.dumps(record))

    try:
        _measure(backend, checkpoint, port, args, record, save)
    except Exception as err:  # noqa: BLE001 - one backend's failure must not lose the other's numbers
        record["error"] = "".join(traceback.format_exception(err))[-4000:]
    save()


def _measure(backend: str, checkpoint: str, port: int, args: dict, record: dict, save) -> None:
    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from trainers.base import DSAOptions, OptimizerConfig, policy_config  # noqa: PLC0415

    cuda = args["device"] == "cuda"
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    dsa = DSAOptions(indexer_loss_coef=1.0, indexer_stage="sparse", indexer_target="group")
    micro_batch_tokens = args["micro_batch_tokens"] // (2 if backend == "fsdp_split" else 1)
    config = policy_config(checkpoint, PPOLoss(), OptimizerConfig(learning_rate=args["lr"], max_grad_norm=1.0),
                           dsa=dsa, ops_backend="torch" if backend == "fsdp_f32" else "auto",
                           mixed_precision=cuda and backend != "fsdp_f32", micro_batch_tokens=micro_batch_tokens,
                           seed=0, gradient_checkpointing=args["recompute"])
    if backend.startswith("megatron"):
        from trainers.megatron.optimizer import DistributedAdam  # noqa: PLC0415
        from trainers.megatron.worker import MegatronWorker as Worker  # noqa: PLC0415

        DistributedAdam.torch_paths = backend != "megatron_stock"
    else:
        from trainers.fsdp.worker import FSDPWorker as Worker  # noqa: PLC0415
    start = time.perf_counter()
    worker = Worker(0, 1, "127.0.0.1", port, config)
    record["build_s"] = round(time.perf_counter() - start, 1)
    save()
    try:
        _conformance_steps(worker, args, record)
    except Exception as err:  # noqa: BLE001 - the timed steps below still measure throughput
        record["conformance_error"] = "".join(traceback.format_exception(err))[-4000:]
    save()
    if backend == "fsdp_f32":  # the reference of the conformance only: no timed steps
        worker.shutdown()
        return
    big = make_batch(args["vocab"], args["bench_samples"], args["length"], 100)
    big.old_logprobs = worker.compute_logprobs(big)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step() -> None:
        worker.train_step(big, float(big.loss_mask.sum()), len(big.seqlens), detailed_metrics=False)

    for _ in range(args["warmup"]):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    each = []
    for _ in range(args["timed"]):  # each step timed to a sync: the median is robust to one slow step
        start = time.perf_counter()
        step()
        sync()
        each.append(time.perf_counter() - start)
    seconds = statistics.median(each)
    record.update(step_s=round(seconds, 4), step_s_each=[round(t, 4) for t in each],
                  tokens_per_s=round(big.num_tokens / seconds, 1),
                  peak_memory_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None)
    save()
    if args.get("profile_dir") and backend in PROFILED:
        record["profile"] = profile_step(step, sync, cuda, backend, Path(args["profile_dir"]))
        save()
    worker.shutdown()


def _conformance_steps(worker, args: dict, record: dict) -> None:
    """STEPS steps on the conformance batches (π_old: the starting policy); the log-probs before each, its metrics."""
    batches = [make_batch(args["vocab"], args["conformance_samples"], args["length"], seed) for seed in range(STEPS)]
    for b in batches:
        b.old_logprobs = worker.compute_logprobs(b)  # π_old: the starting policy, so the loss moves with the weights
    steps, logprobs = [], []
    for b in batches:
        logprobs.append(worker.compute_logprobs(b).float().tolist())
        m = worker.train_step(b, float(b.loss_mask.sum()), len(b.seqlens))
        steps.append({k: m[k] for k in ("loss", "grad_norm", "indexer_kl") if k in m})
    record.update(steps=steps, logprobs=logprobs)


PROFILED = ("fsdp", "megatron")
PROFILE_FILE = "megatron_vs_fsdp_profile.txt"
# Host-device syncs, copies and launches counted from the profile's runtime (CPU-side) events.
COUNTED = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
           "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "aten::_local_scalar_dense",
           "Memcpy DtoH")  # the last: every device-to-host copy (its key names the destination memory)


def profile_step(step, sync, cuda: bool, backend: str, directory: Path) -> dict:
    """One more train step under torch.profiler: its key_averages tables (top 25 by device time, top 25 by CPU time)
    appended to directory/PROFILE_FILE; a summary for the JSON (times in ms)."""
    from torch.autograd import DeviceType  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        sync()
    wall_ms = (time.perf_counter() - start) * 1e3
    events = prof.key_averages()
    on_device = [e for e in events if e.device_type != DeviceType.CPU]
    kernel_ms = sum(e.self_device_time_total for e in on_device) / 1e3
    counts = {name: sum(e.count for e in events if e.key == name or name == "Memcpy DtoH" and e.key.startswith(name))
              for name in COUNTED}
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / PROFILE_FILE, "a") as f:
        f.write(f"== {backend}: one train step under the profiler, {wall_ms:.1f} ms wall, {kernel_ms:.1f} ms of "
                f"device time ==\n")
        for key in (("self_device_time_total",) if cuda else ()) + ("self_cpu_time_total",):
            f.write(f"-- top 25 by {key}\n{events.table(sort_by=key, row_limit=25, max_name_column_width=70)}\n")
    top = sorted(events, key=lambda e: e.self_device_time_total if cuda else e.self_cpu_time_total, reverse=True)
    return {"step_ms": round(wall_ms, 1), "device_ms": round(kernel_ms, 1),
            "device_busy": round(kernel_ms / wall_ms, 3) if cuda else None,
            "counts": {k: v for k, v in counts.items() if v},
            # per op: [self device ms, self CPU ms, calls], for profile_differences
            "ops": {e.key: [round(e.self_device_time_total / 1e3, 3), round(e.self_cpu_time_total / 1e3, 3), e.count]
                    for e in top[:200]}}


def profile_differences(fsdp: dict, megatron: dict, rows: int = 10) -> list[str]:
    """Log lines: the profiled steps side by side, and the ops whose self device time, then self CPU time, is most
    larger in Megatron's step than in FSDP2's (an op in one top-200 only counts 0 in the other)."""
    lines = [f"profile {name}: step {p['step_ms']} ms, device {p['device_ms']} ms (busy {p['device_busy']}), "
             f"{p['counts']}" for name, p in (("fsdp", fsdp), ("megatron", megatron))]
    for index, what in ((0, "device"), (1, "CPU")):
        gaps = {k: megatron["ops"].get(k, [0, 0, 0])[index] - fsdp["ops"].get(k, [0, 0, 0])[index]
                for k in set(fsdp["ops"]) | set(megatron["ops"])}
        worst = [k for k in sorted(gaps, key=gaps.get, reverse=True)[:rows] if gaps[k] > 0]
        lines.append(f"self {what} ms, megatron - fsdp (calls megatron / fsdp): " + ("; ".join(
            f"{k[:60]} {gaps[k]:+.2f} ({megatron['ops'].get(k, [0, 0, 0])[2]} / {fsdp['ops'].get(k, [0, 0, 0])[2]})"
            for k in worst) or "none"))
    return lines


def compare(ref: dict, got: dict, noise: dict | None = None) -> dict:
    """The bf16 conformance figures of `got` against `ref` (FSDP2), and whether each (the log-probs' step by step) is
    within TOLERANCE or within NOISE_FACTOR x the same figure of `noise` (another FSDP2 run's, when given)."""
    loss = max(abs(a["loss"] - b["loss"]) for a, b in zip(ref["steps"], got["steps"]))
    norm = max(abs(a["grad_norm"] - b["grad_norm"]) / max(abs(a["grad_norm"]), 1e-12)
               for a, b in zip(ref["steps"], got["steps"]))
    per_step = [float((torch.tensor(a) - torch.tensor(b)).abs().mean()) for a, b in zip(ref["logprobs"], got["logprobs"])]
    figures = {"loss_abs": loss, "grad_norm_rel": norm, "logprob_mean_abs": max(per_step)}
    def within(value: float, key: str, floor: float | None) -> bool:
        return value <= TOLERANCE[key] or (floor is not None and value <= NOISE_FACTOR * floor)

    floors = noise["logprob_mean_abs_per_step"] if noise else [None] * len(per_step)
    return {**{k: float(f"{v:.3g}") for k, v in figures.items()},
            "logprob_mean_abs_per_step": [float(f"{x:.3g}") for x in per_step],  # step 1: the same weights
            "tolerance": TOLERANCE,
            "within": all(within(figures[k], k, noise[k] if noise else None) for k in ("loss_abs", "grad_norm_rel"))
            and all(within(x, "logprob_mean_abs", f) for x, f in zip(per_step, floors))}


def _step_figures(ref: dict, got: dict) -> list[dict]:
    """Per step: |Δloss|, relative |Δgrad norm| and mean |Δlogp| of `got` from `ref`."""
    return [{"loss_abs": abs(a["loss"] - b["loss"]),
             "grad_norm_rel": abs(a["grad_norm"] - b["grad_norm"]) / max(abs(a["grad_norm"]), 1e-12),
             "logprob_mean_abs": float((torch.tensor(la) - torch.tensor(lb)).abs().mean())}
            for a, b, la, lb in zip(ref["steps"], got["steps"], ref["logprobs"], got["logprobs"])]


def compare_float32(f32: dict, fsdp: dict, megatron: dict) -> dict:
    """Megatron's and FSDP2 bf16's distances from the float32 run at every step, and whether Megatron's are each
    within NOISE_FACTOR x FSDP2's or within TOLERANCE (module docstring)."""
    mine, theirs = _step_figures(f32, megatron), _step_figures(f32, fsdp)
    verdicts = [all(m[k] <= TOLERANCE[k] or m[k] <= NOISE_FACTOR * t[k] for k in TOLERANCE)
                for m, t in zip(mine, theirs)]
    def rounded(rows):
        return [{k: float(f"{v:.3g}") for k, v in r.items()} for r in rows]
    return {"megatron_from_float32": rounded(mine), "fsdp_from_float32": rounded(theirs),
            "within_per_step": verdicts, "within": all(verdicts), "noise_factor": NOISE_FACTOR, "tolerance": TOLERANCE}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--backends", default="fsdp,megatron,fsdp_split,fsdp_f32",
                        help="comma-separated, run in this order (fsdp_split: the noise floor, fsdp_f32: the float32 "
                             "reference, see above; megatron_stock: Megatron with megatron's own AdamW, grad norm, "
                             "clip and main-weight copy, as before trainers/megatron/optimizer.py replaced them)")
    parser.add_argument("--layerwise", action="store_true",
                        help="then benchmarks/megatron_layerwise.py on the same checkpoint and conformance batch "
                             "(where Megatron's bf16 forward first differs from FSDP2's)")
    parser.add_argument("--length", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--conformance-samples", type=int, default=4, help="sequences per conformance step")
    parser.add_argument("--bench-samples", type=int, default=16, help="sequences per timed step")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timed", type=int, default=10, help="timed steps per backend (median)")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--recompute", action="store_true", help="activation recomputation in both backends")
    parser.add_argument("--profile-dir", default=None,
                        help="profile one extra train step of fsdp and megatron into DIR/" + PROFILE_FILE)
    parser.add_argument("--workdir", default=None, help="where the checkpoint goes (default: a temporary directory)")
    parser.add_argument("--out", required=True, help="the JSON result")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from slime_dsa.checkpoint.hf_format import build_model, save_pretrained  # noqa: PLC0415
    from slime_dsa.models.flops import active_params, peak_tflops, train_flops  # noqa: PLC0415
    from slime_dsa.models.presets import preset_config  # noqa: PLC0415

    size = dict(SIZES[args.size])
    config = preset_config("tiny", eos_token_id=1, **size)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="mg_vs_fsdp_"))
    checkpoint = work / f"model_{args.size}"
    # bf16 on disk for the GPU run (half the bytes to write and read); both backends start from the same values
    model = build_model(config, seed=0, dtype=torch.bfloat16 if args.device == "cuda" else torch.float32)
    total = sum(p.numel() for p in model.parameters())
    active = active_params(config)
    flops = train_flops(active, 1)  # per token
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else None
    peak = peak_tflops(device_name, bf16=True)
    if not (checkpoint / "config.json").exists():
        save_pretrained(model, checkpoint)
    del model
    logger.info("model %s: %.3fB parameters (%.3fB active), %.3g FLOPs/token; checkpoint %s", args.size, total / 1e9,
                active / 1e9, flops, checkpoint)
    options = {**vars(args), "vocab": config.vocab_size}
    result = {"size": args.size, "parameters": total, "active_parameters": active, "flops_per_token": flops,
              "device": args.device, "device_name": device_name or "cpu", "peak_tflops": peak,
              "tokens_per_step": args.bench_samples * args.length, "args": vars(args), "runs": {}}
    if args.profile_dir:
        (Path(args.profile_dir) / PROFILE_FILE).unlink(missing_ok=True)
    signal.signal(signal.SIGTERM, _stop)  # the stage's time cap: keep what the running backend finished
    try:
        for backend in args.backends.split(","):
            _run_backend(backend, result, str(checkpoint), options, work, peak, flops, args.out)
    except Stopped as stop:
        result["stopped"] = str(stop)
        _write(args.out, result)
        logger.info("stopped (%s): the JSON holds what finished", stop)
    _log_summary(result)
    if args.layerwise and "stopped" not in result:
        _layerwise(result, str(checkpoint), args, work)  # a SIGTERM there is recorded as its error
    logger.info("%s", _verdict_line(result))


class Stopped(Exception):
    """SIGTERM (the stage's time cap) arrived."""


def _stop(signum, _frame) -> None:
    raise Stopped(f"signal {signum}")


def _run_backend(backend: str, result: dict, checkpoint: str, options: dict, work: Path, peak: float | None,
                 flops: float, out_path: str) -> None:
    """One backend's process; its record (or what it wrote before it stopped) into result['runs']."""
    import torch.multiprocessing as mp  # noqa: PLC0415

    out = work / f"{backend}.json"
    out.unlink(missing_ok=True)
    start = time.perf_counter()
    stopped = None
    try:
        mp.start_processes(rank_body, args=(backend, checkpoint, free_port(), options, str(out)), nprocs=1,
                           start_method="spawn")
    except Stopped as stop:
        stopped = stop
    except Exception as err:  # noqa: BLE001 - the process died (a signal, out of memory): record it, go on
        stopped = err
    run = json.loads(out.read_text()) if out.exists() else {"backend": backend}
    if stopped is not None:
        run.setdefault("error", f"{type(stopped).__name__}: {stopped} (the record holds what it finished)")
    run["wall_s"] = round(time.perf_counter() - start, 1)
    if "tokens_per_s" in run and peak:
        run["mfu"] = round(flops * run["tokens_per_s"] / (peak * 1e12), 4)
    if "tokens_per_s" in run and "tokens_per_s" in result["runs"].get("fsdp", {}) and backend != "fsdp":
        run["over_fsdp"] = round(run["tokens_per_s"] / result["runs"]["fsdp"]["tokens_per_s"], 3)
    result["runs"][backend] = run
    _summarise(result)
    _write(out_path, result)  # after each backend: a run cut short by the stage's time cap still reports
    logger.info("%s: %s%s", backend, {k: run.get(k) for k in ("tokens_per_s", "mfu", "over_fsdp", "step_s",
                                                               "peak_memory_gib", "build_s", "wall_s")},
                f"; error: {run['error'][-600:]}" if "error" in run else "")
    if "conformance_error" in run:
        logger.info("%s conformance error: %s", backend, run["conformance_error"][-600:])
    if "megatron_over_fsdp_tokens_per_s" in result and backend == "megatron":
        logger.info("megatron / fsdp tokens/s %s", result["megatron_over_fsdp_tokens_per_s"])
        if all("profile" in result["runs"][b] for b in PROFILED):
            for line in profile_differences(result["runs"]["fsdp"]["profile"], result["runs"]["megatron"]["profile"]):
                logger.info("%s", line)
    if isinstance(stopped, Stopped):
        raise stopped


def _verdict_line(result: dict) -> str:
    """The throughput of FSDP2 and Megatron and the two conformance verdicts, in one line (the log's last)."""
    runs = result["runs"]
    speed = ", ".join(f"{b} {runs[b].get('tokens_per_s')} tok/s (MFU {runs[b].get('mfu')})" for b in PROFILED
                      if b in runs)
    return (f"verdict: {speed}; megatron / fsdp {result.get('megatron_over_fsdp_tokens_per_s')}; conformance "
            f"vs FSDP2 {result.get('conformance', {}).get('within')}, vs float32 "
            f"{result.get('conformance_float32', {}).get('within')}")


def _log_summary(result: dict) -> None:
    logger.info("noise floor (fsdp vs fsdp_split) %s", result.get("noise_floor"))
    logger.info("conformance %s; megatron / fsdp tokens/s %s", result.get("conformance"),
                result.get("megatron_over_fsdp_tokens_per_s"))
    for line in _float32_lines(result.get("conformance_float32")):
        logger.info("%s", line)


def _float32_lines(verdict: dict | None) -> list[str]:
    """The float32 verdict step by step: each figure as Megatron's / FSDP2 bf16's distance from float32."""
    if not verdict:
        return ["conformance against float32: not computed (a backend of fsdp, megatron, fsdp_f32 missing)"]
    lines = [f"conformance against float32 (Megatron within {NOISE_FACTOR} x FSDP2 bf16's distance, or TOLERANCE): "
             f"{'within' if verdict['within'] else 'MISSED'}"]
    for step, (m, f, ok) in enumerate(zip(verdict["megatron_from_float32"], verdict["fsdp_from_float32"],
                                          verdict["within_per_step"]), start=1):
        lines.append(f"  step {step}: " + ", ".join(f"{k} {m[k]:.3g} / {f[k]:.3g}" for k in TOLERANCE)
                     + ("" if ok else "  MISSED"))
    return lines


def _layerwise(result: dict, checkpoint: str, args: argparse.Namespace, work: Path) -> None:
    """benchmarks/megatron_layerwise.py on the first conformance batch's sequence lengths, into result['layerwise']."""
    from benchmarks.megatron_layerwise import spawn, summary  # noqa: PLC0415

    # On CPU the grouped-GEMM experts (the GPU's bf16 path) are forced: Megatron never trains in bf16 on a CPU, and
    # the per-expert loop there gathers rows (and sums their gradients) unlike the GPU's path.
    options = {"device": args.device, "seqlens": [args.length] * args.conformance_samples,
               "grouped": args.device == "cpu"}
    start = time.perf_counter()
    try:
        result["layerwise"] = spawn(checkpoint, options, str(work / "layerwise.json"))
    except Exception as err:  # noqa: BLE001 - the throughput and conformance above are already written
        result["layerwise"] = {"error": f"{type(err).__name__}: {err}"}
    result["layerwise"]["wall_s"] = round(time.perf_counter() - start, 1)
    _write(args.out, result)
    for line in summary(result["layerwise"]) if "error" not in result["layerwise"] else [result["layerwise"]["error"]]:
        logger.info("layerwise: %s", line)


def _summarise(result: dict) -> None:
    """The noise floor, the conformance and the throughput ratio, from the runs finished so far."""
    runs = result["runs"]
    if all("steps" in runs.get(b, {}) for b in ("fsdp", "fsdp_split")):
        result["noise_floor"] = compare(runs["fsdp"], runs["fsdp_split"])
    if all("steps" in runs.get(b, {}) for b in ("fsdp", "megatron")):
        result["conformance"] = compare(runs["fsdp"], runs["megatron"], result.get("noise_floor"))
    if all("tokens_per_s" in runs.get(b, {}) for b in ("fsdp", "megatron")):
        result["megatron_over_fsdp_tokens_per_s"] = round(runs["megatron"]["tokens_per_s"] / runs["fsdp"]["tokens_per_s"], 3)
    if all("steps" in runs.get(b, {}) for b in ("fsdp", "megatron", "fsdp_f32")):
        result["conformance_float32"] = compare_float32(runs["fsdp_f32"], runs["fsdp"], runs["megatron"])


def _write(path: str, result: dict) -> None:
    """The result without the per-token log-probs (thousands of floats, only for compare)."""
    slim = {**result, "runs": {b: {k: v for k, v in r.items() if k != "logprobs"} for b, r in result["runs"].items()}}
    Path(path).write_text(json.dumps(slim, indent=1))


if __name__ == "__main__":
    main()
