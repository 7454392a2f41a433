"""One RL train call of one FSDP2 rank under torch.profiler, at short and long sequences: where the step's time goes.

The call `recipes/gpu_single.yaml` makes each step (GRPO loss, bf16 mixed precision, the indexer's KL loss, π_old
given): step time, train tokens/s, MFU, the share of the step the GPU is busy (the union of kernel intervals over the
wall time), the host syncs (`aten::_local_scalar_dense`, `cudaStreamSynchronize`) and the top ops by CUDA and CPU time.
    python benchmarks/profile_train_step.py --out profile.md                      # H200: preset small, 100/300/1000
    python benchmarks/profile_train_step.py --device cpu --preset tiny --lengths 32,96 --samples 4 --out p.md
--compare-fsdp2 also runs each length through FSDP2 on the one rank (the path before the bf16 copy), in the same
process, as the baseline. --compile also runs each length with trainer.compile (each decoder layer torch.compile'd,
trainers/fsdp/parallelize.apply_compile) in the same process, and the table gives its step time against the eager
rank's ("vs first compute"); first call s is a length's π_old pass and first step (for the compiled rank's first
length, its compile). launches: CUDA kernel launches in the profiled step. --sync-sites (CUDA) runs one more step per
length under torch's sync debug mode (benchmarks/sync_sites.py) and lists the code that made each host sync.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import sync_sites  # beside this script
from trainers.process_group import free_port

logger = logging.getLogger("profile_train_step")
SYNC_OPS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync")


def make_batch(vocab: int, samples: int, length: int, seed: int):
    """`samples` packed sequences of `length` tokens, the prompt a quarter of each; advantages ±1 per sample."""
    from trainers.base import TrainBatch  # noqa: PLC0415

    g = torch.Generator().manual_seed(seed)
    prompt = length // 4
    mask = ([0.0] * prompt + [1.0] * (length - prompt)) * samples
    adv = sum(([0.0] * prompt + [-1.0 if s % 2 else 1.0] * (length - prompt) for s in range(samples)), [])
    n = samples * length
    return TrainBatch(input_ids=torch.randint(2, vocab, (n,), generator=g), seqlens=[length] * samples,
                      loss_mask=torch.tensor(mask), rollout_logprobs=torch.full((n,), -2.0),
                      advantages=torch.tensor(adv))


def gpu_busy_share(events: list, wall_us: float) -> float:
    """The share of `wall_us` covered by at least one GPU kernel or copy (the union of their intervals)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy / wall_us if wall_us > 0 else 0.0


def fsdp2_one_rank_worker():
    """FSDPWorker that wraps even one rank with FSDP2 (the path before trainers/fsdp/bf16_compute.py): the baseline."""
    from trainers.fsdp.worker import FSDPWorker  # noqa: PLC0415

    class FSDP2OneRank(FSDPWorker):
        def _build_role(self, name, config):
            self.sharded = True
            return super()._build_role(name, config)

    return FSDP2OneRank


def profile_length(worker, vocab: int, samples: int, length: int, timed: int, cuda: bool,
                   with_sites: bool = False) -> dict:
    """Warm up, time `timed` train steps, then profile one (and with `with_sites` run one more under the sync debug
    mode); the figures of this sequence length."""
    batch = make_batch(vocab, samples, length, seed=length)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    tokens, loss_tokens = batch.num_tokens, float(batch.loss_mask.sum())

    def step() -> None:
        worker.train_step(batch, loss_tokens, len(batch.seqlens), detailed_metrics=False)

    start = time.perf_counter()
    batch.old_logprobs = worker.compute_logprobs(batch)
    step()  # Triton compilation (and torch.compile's, with trainer.compile), allocator warm-up
    sync()
    first_call_s = time.perf_counter() - start
    step()
    sync()
    start = time.perf_counter()
    for _ in range(timed):
        step()
    sync()
    step_s = (time.perf_counter() - start) / timed
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        sync()
        profiled_s = time.perf_counter() - start
    sites = None
    if with_sites and cuda:
        with sync_sites.SyncSites(depth=3) as recorder:
            step()
            sync()
        sites = recorder.summary(top=20)
    events = prof.events()
    averages = prof.key_averages()
    syncs = {e.key: e.count for e in averages if e.key in SYNC_OPS}
    launches = sum(e.count for e in averages if "LaunchKernel" in e.key)  # cudaLaunchKernel(ExC), cuLaunchKernel
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    return {"length": length, "samples": samples, "tokens": tokens, "first_call_s": round(first_call_s, 2),
            "step_s": round(step_s, 4),
            "tokens_per_s": round(tokens / step_s, 1), "profiled_step_s": round(profiled_s, 4),
            "gpu_busy": round(gpu_busy_share(events, profiled_s * 1e6), 3) if cuda else None,
            "host_syncs": syncs, "kernel_launches": launches if cuda else None, "sync_sites": sites,
            "top_cuda": averages.table(sort_by=sort, row_limit=15, max_name_column_width=55),
            "top_cpu": averages.table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=55)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small", help="model preset (recipes/gpu_single.yaml's policy: small)")
    parser.add_argument("--vocab", type=int, default=384, help="vocabulary (countdown's built-in tokenizer)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--lengths", default="100,300,1000", help="tokens per sequence, one profile each")
    parser.add_argument("--tokens-per-step", type=int, default=65536, help="samples = this / length (at least 1)")
    parser.add_argument("--samples", type=int, default=None, help="samples per step (overrides --tokens-per-step)")
    parser.add_argument("--micro-batch-tokens", type=int, default=32768)
    parser.add_argument("--timed", type=int, default=3)
    parser.add_argument("--compare-fsdp2", action="store_true", help="also time FSDP2 on one rank, the baseline")
    parser.add_argument("--compile", action="store_true", help="also time each length with trainer.compile (each "
                        "decoder layer torch.compile'd), in the same process: compiled against eager")
    parser.add_argument("--sync-sites", action="store_true", help="CUDA: one more step per length under the sync debug "
                        "mode; the report lists the code that made each host sync (benchmarks/sync_sites.py)")
    parser.add_argument("--out", required=True, help="a Markdown report; a .json of the same name holds the figures")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from slime_dsa.checkpoint.hf_format import build_model, save_pretrained  # noqa: PLC0415
    from slime_dsa.models.flops import active_params, peak_tflops, train_flops  # noqa: PLC0415
    from slime_dsa.models.presets import preset_config  # noqa: PLC0415
    from trainers.base import DSAOptions, OptimizerConfig, policy_config  # noqa: PLC0415
    from trainers.fsdp.worker import FSDPWorker  # noqa: PLC0415

    cuda = args.device == "cuda"
    config = preset_config(args.preset, vocab_size=args.vocab, eos_token_id=1)
    checkpoint = Path(tempfile.mkdtemp(prefix="profile_train_")) / "model"
    save_pretrained(build_model(config, seed=0, dtype=torch.float32), checkpoint)
    dsa = DSAOptions(indexer_loss_coef=1.0, indexer_stage="sparse", indexer_target="group")
    rank = policy_config(str(checkpoint), PPOLoss(), OptimizerConfig(learning_rate=1e-5, max_grad_norm=1.0), dsa=dsa,
                         ops_backend="auto", mixed_precision=cuda, micro_batch_tokens=args.micro_batch_tokens, seed=0)
    flops_per_token = train_flops(active_params(config), 1)
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = peak_tflops(device_name, bf16=True) if cuda else None
    eager = "bf16 copy" if cuda else "one rank"
    workers = {eager: (FSDPWorker, rank)}
    if args.compare_fsdp2:
        workers["FSDP2"] = (fsdp2_one_rank_worker(), rank)
    if args.compile:
        workers[f"{eager}, compiled"] = (FSDPWorker, dataclasses.replace(rank, compile=True))
    rows = []
    for compute, (worker_class, rank_config) in workers.items():
        worker = worker_class(0, 1, "127.0.0.1", free_port(), rank_config)
        for length in (int(x) for x in args.lengths.split(",")):
            samples = args.samples or max(1, args.tokens_per_step // length)
            try:
                row = {"compute": compute, **profile_length(worker, args.vocab, samples, length, args.timed, cuda,
                                                                      args.sync_sites)}
                row["mfu"] = round(flops_per_token * row["tokens_per_s"] / (peak * 1e12), 4) if peak else None
                logger.info("%s, length %d: %s", compute, length, {k: row[k] for k in (
                    "first_call_s", "step_s", "tokens_per_s", "mfu", "gpu_busy", "host_syncs")})
            except torch.OutOfMemoryError as error:  # this length does not fit: the others still run and report
                logger.error("%s, length %d: out of memory", compute, length)
                row = {"compute": compute, "length": length, "samples": samples,
                       "error": f"out of memory: {str(error).splitlines()[0]}"}
                torch.cuda.empty_cache()
            rows.append(row)
            write_report(args, device_name, config, rows, echo=False)  # after each length: a later failure keeps these
        worker.shutdown()
    write_report(args, device_name, config, rows)


def write_report(args: argparse.Namespace, device_name: str, config, rows: list[dict], echo: bool = True) -> None:
    """The Markdown report (summary table, then each length's top ops) and its JSON twin; `echo` prints the table."""
    lines = [f"# One RL train call, preset {args.preset}, {device_name}", "",
             "| compute | tokens/seq | samples | first call s | step s | vs first compute | tokens/s | MFU | GPU busy "
             "| launches | host syncs |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    # The first compute's step time at each length over this row's: > 1 is faster than it (same process, same device).
    first = {r["length"]: r["step_s"] for r in rows if r["compute"] == rows[0]["compute"] and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['compute']} | {r['length']} | {r['samples']} | {r['error']} | | | | | | | |")
            continue
        ratio = f"{first[r['length']] / r['step_s']:.2f}x" if r["length"] in first else ""
        lines.append(f"| {r['compute']} | {r['length']} | {r['samples']} | {r.get('first_call_s')} | {r['step_s']} | "
                     f"{ratio} | {r['tokens_per_s']:,.0f} | {r['mfu']} | {r['gpu_busy']} | "
                     f"{r.get('kernel_launches')} | {r['host_syncs']} |")
    for r in rows:
        if "error" in r:
            continue
        if r.get("sync_sites"):
            found = r["sync_sites"]
            lines += ["", f"## {r['compute']}, {r['length']} tokens/seq: host syncs by site ({found['syncs']} in one "
                      f"step; probe seen: {found['probe_seen']})", ""]
            lines += [f"- {site['-']} x `{site['site']}`" for site in found["sites"]]
        lines += ["", f"## {r['compute']}, {r['length']} tokens/seq: top ops", "```", r["top_cuda"], "```", "```", r["top_cpu"], "```"]
    Path(args.out).write_text("\n".join(lines) + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps(
        {"args": vars(args), "device": device_name, "index_topk": config.index_topk,
         "rows": [{k: v for k, v in r.items() if not k.startswith("top_")} for r in rows]}, indent=1))
    if echo:
        print("\n".join(lines[:4 + len(rows)]))


if __name__ == "__main__":
    main()
