"""Output tokens/s of the embedded engine vs transformers `generate`, same random GLM-MoE-DSA weights, same prompts.

Both decode greedily with EOS ignored, so every request produces exactly --new-tokens tokens on both sides.
transformers gets the prompts left-padded in one batch; the engine gets them all at once and schedules them
itself (continuous batching, paged cache). Prints a markdown table; --out appends it to a file.

    python benchmarks/engine_throughput.py --device cpu --dtype float32 --preset small
    python benchmarks/engine_throughput.py --device cuda --dtype bfloat16 --preset 300m --out benchmarks/RESULTS.md

Needs torch, transformers, safetensors and this repository only (no ray / wandb / datasets).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout.engine import Engine, GenerateRequest, SamplingParams  # noqa: E402
from slime_dsa.checkpoint import build_model, save_pretrained  # noqa: E402
from slime_dsa.models import ModelConfig  # noqa: E402

logger = logging.getLogger("engine_throughput")

_COMMON = dict(n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
               index_topk_freq=2, max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
               eos_token_id=1)
PRESETS = {
    # name: (config, prompt_len, new_tokens)
    "tiny": (dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48,
                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, index_topk=16, index_head_dim=16, index_n_heads=16),
             24, 24),
    "small": (dict(vocab_size=2048, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
                   num_attention_heads=8, n_routed_experts=16, num_experts_per_tok=4, kv_lora_rank=64, q_lora_rank=96,
                   qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, index_topk=32, index_head_dim=32, index_n_heads=16),
              48, 32),
    # ~290M parameters: GLM-5's shape scaled down (MLA, DSA indexer with IndexShare, 32 routed experts, 1 dense layer).
    "300m": (dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=256, num_hidden_layers=8,
                  num_attention_heads=16, n_routed_experts=32, num_experts_per_tok=4, kv_lora_rank=256, q_lora_rank=384,
                  qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, index_topk=256, index_head_dim=64, index_n_heads=16),
             256, 256),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_prompts(n: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    """Random prompts of lengths in [prompt_len / 2, prompt_len], avoiding the EOS / pad id 1."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(prompt_len // 2, 1), prompt_len + 1, (n,), generator=g).tolist()
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for length in lens]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def run_hf(hf, prompts: list[list[int]], new_tokens: int, device: torch.device) -> tuple[float, list[list[int]]]:
    """One left-padded batch through transformers generate: (seconds, output ids)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), 1, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    sync(device)
    start = time.perf_counter()
    out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=1)
    sync(device)
    return time.perf_counter() - start, out[:, width:].tolist()


ENGINE_OPTIONS: dict = {}  # extra Engine arguments from the command line


def make_engine(model, prompts: list[list[int]], new_tokens: int, block_size: int, cuda_graphs: bool = True) -> Engine:
    """An engine with cache room for every prompt at once."""
    need = sum(-(-(len(p) + new_tokens) // block_size) for p in prompts) * block_size
    return Engine(model, max_cache_tokens=need + block_size, max_running_requests=len(prompts), block_size=block_size,
                  enable_prefix_caching=False, cuda_graphs=cuda_graphs, **ENGINE_OPTIONS)  # random prompts share nothing: keep it plain


def run_engine(engine: Engine, prompts: list[list[int]], new_tokens: int, device: torch.device) -> tuple[float, list[list[int]]]:
    """All prompts into the engine at once, stepped until done: (seconds, output ids).

    Sets run_engine.prefill_s: the time until every prompt token was in the cache (prefill steps, which also
    decode the requests admitted earlier)."""
    sync(device)
    start = time.perf_counter()
    prefilled = engine.stats["prefill_tokens"] + sum(len(p) for p in prompts)
    for i, p in enumerate(prompts):
        sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(GenerateRequest(input_ids=p, sampling=sampling, rid=str(i), stream=False))
    finals, run_engine.prefill_s = {}, None
    while engine.num_running or engine.num_queued:
        for out in engine.step():
            if out.finish_reason is not None:
                finals[out.rid] = out.output_ids
        if run_engine.prefill_s is None and engine.stats["prefill_tokens"] >= prefilled:
            run_engine.prefill_s = time.perf_counter() - start
    sync(device)
    return time.perf_counter() - start, [finals[str(i)] for i in range(len(prompts))]


def profile_decode(model, prompts: list[list[int]], device: torch.device, block_size: int, steps: int = 8,
                   trace: Path | None = None) -> dict:
    """Decode steps alone, once every request is prefilled: mean step time, host syncs per step and where.

    Syncs are counted with torch.cuda.set_sync_debug_mode("warn") over one step; `trace` gets a torch
    profiler table of one step (ops by device time, then by host time).
    """
    new_tokens = 2 * steps + 64  # room for the steps below once the last prompt is in
    engine = make_engine(model, prompts, new_tokens, block_size)
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True), rid=str(i)))
    while engine.num_queued or engine.stats["prefill_tokens"] < sum(len(p) for p in prompts):
        engine.step()
    for _ in range(steps):  # steady state: the decode graphs of this batch are captured
        engine.step()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    step_ms = (time.perf_counter() - start) / steps * 1e3
    result = {"step_ms": step_ms, "syncs": None, "sources": []}
    if device.type == "cuda":
        import collections  # noqa: PLC0415
        import warnings  # noqa: PLC0415

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step()
                sync(device)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        hits = [w for w in caught if "synchroniz" in str(w.message)]
        where = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in hits)
        result.update(syncs=len(hits), sources=where.most_common(8))
        if trace is not None:
            from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                engine.step()
                sync(device)
            table = prof.key_averages()
            trace.write_text(table.table(sort_by="cuda_time_total", row_limit=25) + "\n\n"
                             + table.table(sort_by="self_cpu_time_total", row_limit=25))
    return result


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}"
    try:
        model = next(line.split(":", 1)[1].strip() for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return f"{model}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--batch-sizes", default="64,256", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=None, help="longest prompt (default: the preset's)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens generated per request (default: the preset's)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-prefill-tokens", type=int, default=None, help="the engine's prefill chunk budget (default: the engine's)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--hf-experts", default=None, help="transformers experts_implementation (default: its own choice, eager on failure)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="append the markdown section to this file")
    parser.add_argument("--profile", action="store_true", help="also time decode steps alone and count their host syncs (CUDA)")
    parser.add_argument("--trace", type=Path, default=None, help="with --profile: write a torch profiler table of one decode step here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.max_prefill_tokens:
        ENGINE_OPTIONS["max_prefill_tokens"] = args.max_prefill_tokens
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    overrides, prompt_len, new_tokens = PRESETS[args.preset]
    prompt_len, new_tokens = args.prompt_len or prompt_len, args.new_tokens or new_tokens
    config = ModelConfig.from_dict({**_COMMON, **overrides})
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (heavy; only the baseline needs it)

    model = build_model(config, dtype=dtype, device=device, seed=args.seed).eval()
    n_params = sum(p.numel() for p in model.parameters())
    warm = make_prompts(4, prompt_len, config.vocab_size, args.seed + 1)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        for experts in ([args.hf_experts] if args.hf_experts else [None, "eager"]):
            kwargs = {"experts_implementation": experts} if experts else {}
            hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, **kwargs).to(device).eval()
            try:
                run_hf(hf, warm, 4, device)
                break
            except Exception as exc:  # noqa: BLE001 - e.g. grouped_mm unsupported here: use the reference loop
                if experts == "eager" or args.hf_experts:
                    raise
                logger.warning("transformers with experts %s failed (%s); retrying with eager experts", hf.config._experts_implementation, exc)
    hf_impl = f"attention `{hf.config._attn_implementation}`, experts `{hf.config._experts_implementation}`"
    logger.info("preset %s: %.1fM parameters, %s %s, transformers %s", args.preset, n_params / 1e6, device, dtype, hf_impl)
    # Full length: kernels compile before timing.
    run_engine(make_engine(model, warm, new_tokens, args.block_size), warm, new_tokens, device)
    graphs = device.type == "cuda"

    rows = []
    for batch in batch_sizes:
        prompts = make_prompts(batch, prompt_len, config.vocab_size, args.seed + batch)
        hf_s, hf_out = run_hf(hf, prompts, new_tokens, device)
        logger.info("batch %d: transformers %.2fs", batch, hf_s)
        engine = make_engine(model, prompts, new_tokens, args.block_size)
        cold_s, _ = run_engine(engine, prompts, new_tokens, device)  # on CUDA: captures the decode graphs it needs
        eng_s, eng_out = run_engine(engine, prompts, new_tokens, device)  # the same engine, as in an RL loop
        prefill_s = run_engine.prefill_s
        eager_s = None
        if graphs:
            eager_s, _ = run_engine(make_engine(model, prompts, new_tokens, args.block_size, cuda_graphs=False), prompts, new_tokens, device)
        logger.info("batch %d: engine %.2fs (prefill %.2fs; first run %.2fs, without CUDA graphs %s)", batch, eng_s, prefill_s, cold_s, eager_s)
        assert all(len(o) == new_tokens for o in hf_out + eng_out), "both sides must produce --new-tokens tokens per request"
        same = sum(a == b for a, b in zip(hf_out, eng_out)) / batch
        tokens = batch * new_tokens
        rows.append((batch, tokens / hf_s, tokens / eng_s, hf_s / eng_s, prefill_s / eng_s, tokens / cold_s,
                     None if eager_s is None else tokens / eager_s, same))

    profiles = []
    if args.profile:
        for batch in batch_sizes:
            prompts = make_prompts(batch, prompt_len, config.vocab_size, args.seed + batch)
            trace = args.trace.with_suffix(f".b{batch}.txt") if args.trace else None
            prof = profile_decode(model, prompts, device, args.block_size, trace=trace)
            logger.info("batch %d: decode step %.2f ms, %s host syncs per step: %s", batch, prof["step_ms"], prof["syncs"], prof["sources"])
            profiles.append((batch, prof))

    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0]] + (argv if argv is not None else sys.argv[1:]))
    lines = [
        f"### Engine throughput: preset `{args.preset}` ({n_params / 1e6:.1f}M params), {device.type} {str(dtype).removeprefix('torch.')}",
        "",
        f"- date: {datetime.date.today().isoformat()}; hardware: {hardware(device)}; torch {torch.__version__}",
        f"- greedy, EOS ignored, prompts of {max(prompt_len // 2, 1)}-{prompt_len} tokens, {new_tokens} new tokens per request; "
        f"transformers `generate` (one left-padded batch, {hf_impl}) vs the embedded engine (block size {args.block_size})",
        f"- command: `{command}`",
        "",
        "| batch | transformers tok/s | engine tok/s | engine / transformers | engine time in prefill | engine first run tok/s | engine without CUDA graphs tok/s | identical outputs |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(f"| {b} | {h:.1f} | {e:.1f} | {r:.2f}x | {pf:.0%} | {c:.1f} | {'-' if g is None else f'{g:.1f}'} | {s:.0%} |" for b, h, e, r, pf, c, g, s in rows),
        "",
        "- engine tok/s: the second run of the batch through the same engine (an RL engine serves many batches);"
        " the first run also captures the CUDA graphs (CUDA only) and compiles kernels for new shapes.",
        *(f"- decode step alone at batch {b} (all requests prefilled): {p['step_ms']:.2f} ms; host syncs in one step: "
          f"{p['syncs']} ({', '.join(f'{w} x{n}' for w, n in p['sources'])})" for b, p in profiles),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write("\n" + text)
    return text


if __name__ == "__main__":
    main()
