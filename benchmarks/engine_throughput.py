"""Output tokens/s of the embedded engine vs transformers `generate`, same random GLM-MoE-DSA weights, same prompts.

The simple path: both decode greedily with EOS ignored, so every request produces exactly --new-tokens tokens on
both sides. transformers gets the prompts left-padded in one batch; the engine gets them all at once and schedules
them itself (continuous batching, paged cache).

The rollout path (--paths rollout): the engine as an RL step drives it. Groups of --group-size samples of one prompt,
one /generate body per group built and parsed by the code the HTTP server runs (rollout.server.in_process, without
the socket), as rollout.groups sends it: temperature 1 with a sampling seed per sample, return_logprob, a stop
string (checked by decoding each request's tail with a word-level tokenizer over the whole vocabulary), the DSA
top-k rows of every prompt and output row for index replay (--no-replay: off), prefix caching on, and a weight
update (a new version, cache flushed) between the first run and the timed one, as between two RL steps.

Both paths report the engine's decode step time, its host gap (rollout.engine.perf: the share of step time the device
is not working, from CUDA events around each step's device work) and the device's busy share of the whole run. With
--overlap the engine runs its overlap scheduler (each step launched before the previous step's tokens reach the
host); without it, each step's tokens reach the host before the next step launches (the engine's default). Prints markdown tables; --out appends them to a file.

    python benchmarks/engine_throughput.py --device cpu --dtype float32 --preset small
    python benchmarks/engine_throughput.py --device cuda --dtype bfloat16 --preset 300m --out benchmarks/RESULTS.md

Needs torch, transformers, safetensors, aiohttp and this repository only (no ray / wandb / datasets).
"""

from __future__ import annotations

import argparse
import asyncio
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
from rollout.engine import perf as engine_perf  # noqa: E402
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


def model_config(preset: str, context: int = 0) -> ModelConfig:
    """The ModelConfig of one of this benchmark's presets (also the shape of tests/test_true_on_policy_300m.py), its
    context (max_position_embeddings) raised to `context` tokens when that is longer."""
    config = {**_COMMON, **PRESETS[preset][0]}
    config["max_position_embeddings"] = max(config["max_position_embeddings"], context)
    return ModelConfig.from_dict(config)


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
HOST_PHASES = ("schedule_s", "launch_s", "resolve_s", "stop_strings_s", "finish_s")  # Engine.stats: host time by phase


def make_engine(model, prompts: list[list[int]], new_tokens: int, block_size: int, cuda_graphs: bool = True) -> Engine:
    """An engine with cache room for every prompt at once."""
    need = sum(-(-(len(p) + new_tokens) // block_size) for p in prompts) * block_size
    return Engine(model, max_cache_tokens=need + block_size, max_running_requests=len(prompts), block_size=block_size,
                  enable_prefix_caching=False, cuda_graphs=cuda_graphs, **ENGINE_OPTIONS)  # random prompts share nothing: keep it plain


def step_metrics(engine: Engine, before: dict) -> dict:
    """The engine's step-loop metrics since the counters `before` (rollout.engine.perf.step_metrics)."""
    return engine_perf.step_metrics([engine_perf.delta(before, engine_perf.counters(engine.stats))],
                                    [engine.max_running_requests])


def run_engine(engine: Engine, prompts: list[list[int]], new_tokens: int, device: torch.device) -> tuple[float, list[list[int]]]:
    """All prompts into the engine at once, stepped until done: (seconds, output ids).

    Sets run_engine.prefill_s: the time until every prompt token was in the cache (prefill steps, which also
    decode the requests admitted earlier), and run_engine.perf: the step-loop metrics of the run."""
    sync(device)
    before = engine_perf.counters(engine.stats)
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
    run_engine.perf = step_metrics(engine, before)
    return time.perf_counter() - start, [finals[str(i)] for i in range(len(prompts))]


def word_tokenizer(vocab: int):
    """A word-level tokenizer over every id of the model (w0 .. w<vocab-1>): stop strings cost what they cost with
    a real tokenizer, one decode of each request's tail per step, on outputs of a random model."""
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def run_rollout(model, prompts: list[list[int]], group: int, new_tokens: int, block_size: int, device: torch.device,
                tokenizer, replay: bool, stop: list[str], seed: int, release_kv: bool = False) -> dict:
    """The rollout path (module docstring) over `prompts` (each sent as a group of `group` samples): a fresh engine,
    a first run (captures graphs, compiles), a weight update, then the timed run. Returns {"first_s", "s",
    "tokens", "first_tokens", "outside_share", **step metrics of the timed run}. release_kv: then the KV cache is
    released and re-allocated, as a colocated RL step that hands it to the trainer does, and the same run is timed
    again: "released" holds its {"s", "tokens", **step metrics}."""
    return asyncio.run(_rollout(model, prompts, group, new_tokens, block_size, device, tokenizer, replay, stop, seed,
                                release_kv))


async def _rollout(model, prompts, group, new_tokens, block_size, device, tokenizer, replay, stop, seed,
                   release_kv=False) -> dict:
    from rollout.engine import AsyncEngine  # noqa: PLC0415
    from rollout.server.in_process import InProcessClient  # noqa: PLC0415

    n = len(prompts) * group
    need = sum(-(-(len(p) + new_tokens) // block_size) for p in prompts) * group * block_size
    engine = Engine(model, max_cache_tokens=need + block_size, max_running_requests=n, block_size=block_size,
                    tokenizer=tokenizer, keep_indexer_topk=replay, **ENGINE_OPTIONS)
    front = AsyncEngine(engine)
    await front.start()
    client = InProcessClient(front, tokenizer)
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop": list(stop)}
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    async def once(run: int) -> tuple[float, int, dict]:
        sync(device)
        before = engine_perf.counters(engine.stats)
        phases = {k: engine.stats[k] for k in HOST_PHASES}
        start = time.perf_counter()
        outs = await asyncio.gather(*(
            client.generate_batch([p] * group, [{**params, "sampling_seed": (seed * 1_000_003 + (run * n + g * group + k)) % 2**31}
                                                for k in range(group)],
                                  return_logprob=True, session_id=f"group-{run}-{g}", return_indexer_topk=replay,
                                  indexer_topk_start_len=0)
            for g, p in enumerate(prompts)))
        sync(device)
        seconds = time.perf_counter() - start
        tokens = sum(o["meta_info"]["completion_tokens"] for group_outs in outs for o in group_outs)
        perf = step_metrics(engine, before)
        steps = max(perf.get("steps", 0), 1)
        perf["phase_ms"] = {k.removesuffix("_s"): (engine.stats[k] - phases[k]) / steps * 1e3 for k in HOST_PHASES}
        return seconds, tokens, perf

    try:
        first_s, first_tokens, _ = await once(0)
        await front.update_weights(weights, weight_version="1")  # as between two RL steps: new version, cache flushed
        seconds, tokens, perf = await once(1)
        released = None
        if release_kv:  # as a colocated step that hands the KV cache to the trainer (its graphs go with it)
            await front.release_memory(["kv_cache"])
            await front.resume_memory(["kv_cache"])
            await front.update_weights(weights, weight_version="2")
            released_s, released_tokens, released_perf = await once(1)  # the same seeds: the same work
            released = {"s": released_s, "tokens": released_tokens, **released_perf}
    finally:
        await front.stop()
    return {"first_s": first_s, "first_tokens": first_tokens, "s": seconds, "tokens": tokens,
            "outside_share": max(0.0, 1 - perf.get("busy_s", 0.0) / seconds),
            "busy_share": perf.get("device_s", 0.0) / seconds, "released": released, **perf}


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
    parser.add_argument("--paths", default="simple,rollout", help="comma-separated: simple (greedy, EOS ignored, one "
                        "engine call per prompt) and/or rollout (as an RL step drives the engine: module docstring)")
    parser.add_argument("--hf-batch-sizes", default=None, help="batch sizes transformers runs at, for the ratios "
                        "(default: every batch size; 'none' skips it)")
    parser.add_argument("--no-eager", action="store_true", help="skip the simple path's run without CUDA graphs")
    parser.add_argument("--group-size", type=int, default=16, help="rollout path: samples per prompt (one /generate each)")
    parser.add_argument("--stop", action="append", default=None, help="rollout path: stop string (repeatable; default </answer>)")
    parser.add_argument("--no-replay", action="store_true", help="rollout path: no DSA top-k rows for index replay")
    parser.add_argument("--release-kv", action="store_true", help="rollout path: also time the run again after "
                        "releasing and re-allocating the KV cache, as a colocated RL step with "
                        "cluster.engine_kv_cache_in_training release does (CUDA graphs captured again)")
    parser.add_argument("--overlap", action="store_true", help="the engine's overlap scheduler (each step launched "
                        "before the previous step's tokens reach the host)")
    parser.add_argument("--index-key-cache-dtype", choices=("auto", "fp8_e4m3"), default="auto",
                        help="the engine's DSA index-key cache (rollout.index_key_cache_dtype)")
    parser.add_argument("--decode-steps", type=int, default=1,
                        help="decode steps a launch (rollout.num_continuous_decode_steps; default 1)")
    parser.add_argument("--torch-compile", action="store_true",
                        help="the engine's pointwise chains through torch.compile (rollout.enable_torch_compile)")
    args = parser.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    if unknown := sorted(set(paths) - {"simple", "rollout"}):
        parser.error(f"--paths: unknown path(s) {unknown}; choose simple and/or rollout")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.max_prefill_tokens:
        ENGINE_OPTIONS["max_prefill_tokens"] = args.max_prefill_tokens
    ENGINE_OPTIONS["overlap"] = args.overlap
    ENGINE_OPTIONS["index_key_cache_dtype"] = args.index_key_cache_dtype
    ENGINE_OPTIONS["num_continuous_decode_steps"] = args.decode_steps
    ENGINE_OPTIONS["enable_torch_compile"] = args.torch_compile
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    overrides, prompt_len, new_tokens = PRESETS[args.preset]
    prompt_len, new_tokens = args.prompt_len or prompt_len, args.new_tokens or new_tokens
    config = model_config(args.preset, context=prompt_len + new_tokens)  # --prompt-len past 4,096 gets the room
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    hf_sizes = set(batch_sizes) if args.hf_batch_sizes is None else (
        set() if args.hf_batch_sizes == "none" else {int(b) for b in args.hf_batch_sizes.split(",")})
    stop = args.stop if args.stop is not None else ["</answer>"]
    if "rollout" in paths and any(b % args.group_size for b in batch_sizes):
        parser.error(f"--batch-sizes must be multiples of --group-size ({args.group_size}) for the rollout path")

    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (heavy; only the baseline needs it)

    model = build_model(config, dtype=dtype, device=device, seed=args.seed).eval()
    n_params = sum(p.numel() for p in model.parameters())
    warm = make_prompts(4, prompt_len, config.vocab_size, args.seed + 1)
    hf, hf_impl = None, "not run"
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        for experts in ([args.hf_experts] if args.hf_experts else [None, "eager"]) if hf_sizes else []:
            kwargs = {"experts_implementation": experts} if experts else {}
            hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, **kwargs).to(device).eval()
            try:
                run_hf(hf, warm, 4, device)
                break
            except Exception as exc:  # noqa: BLE001 - e.g. grouped_mm unsupported here: use the reference loop
                if experts == "eager" or args.hf_experts:
                    raise
                logger.warning("transformers with experts %s failed (%s); retrying with eager experts", hf.config._experts_implementation, exc)
    if hf is not None:
        hf_impl = f"attention `{hf.config._attn_implementation}`, experts `{hf.config._experts_implementation}`"
    logger.info("preset %s: %.1fM parameters, %s %s, transformers %s", args.preset, n_params / 1e6, device, dtype, hf_impl)
    # Full length: kernels compile before timing.
    run_engine(make_engine(model, warm, new_tokens, args.block_size), warm, new_tokens, device)
    graphs = device.type == "cuda"

    rows, rollout_rows, hf_tok_s = [], [], {}
    tokenizer = word_tokenizer(config.vocab_size) if "rollout" in paths else None
    for batch in batch_sizes:
        prompts = make_prompts(batch, prompt_len, config.vocab_size, args.seed + batch)
        tokens = batch * new_tokens
        if batch in hf_sizes:
            hf_s, hf_out = run_hf(hf, prompts, new_tokens, device)
            hf_tok_s[batch] = tokens / hf_s
            logger.info("batch %d: transformers %.2fs, %.0f tok/s", batch, hf_s, tokens / hf_s)
        if "simple" in paths:
            engine = make_engine(model, prompts, new_tokens, args.block_size)
            cold_s, _ = run_engine(engine, prompts, new_tokens, device)  # on CUDA: captures the decode graphs it needs
            eng_s, eng_out = run_engine(engine, prompts, new_tokens, device)  # the same engine, as in an RL loop
            prefill_s, perf = run_engine.prefill_s, run_engine.perf
            eager_s = None
            if graphs and not args.no_eager:
                eager_s, _ = run_engine(make_engine(model, prompts, new_tokens, args.block_size, cuda_graphs=False), prompts, new_tokens, device)
            logger.info("batch %d: engine %.2fs, %.0f tok/s (prefill %.2fs; first run %.2fs, without CUDA graphs %s); decode "
                        "step %s ms, host gap %s, device busy %s of the run", batch, eng_s, tokens / eng_s, prefill_s, cold_s,
                        eager_s, _num(perf.get("decode_step_ms")), _pct(perf.get("decode_host_gap_share")),
                        _pct(perf.get("device_s", 0.0) / eng_s))
            assert all(len(o) == new_tokens for o in eng_out), "the engine must produce --new-tokens tokens per request"
            same = None
            if batch in hf_sizes:
                assert all(len(o) == new_tokens for o in hf_out), "transformers must produce --new-tokens tokens per request"
                same = sum(a == b for a, b in zip(hf_out, eng_out)) / batch
            rows.append((batch, hf_tok_s.get(batch), tokens / eng_s, prefill_s / eng_s, tokens / cold_s,
                         None if eager_s is None else tokens / eager_s, same, {**perf, "busy_share": perf.get("device_s", 0.0) / eng_s}))
        if "rollout" in paths:
            groups = make_prompts(batch // args.group_size, prompt_len, config.vocab_size, args.seed + batch)
            r = run_rollout(model, groups, args.group_size, new_tokens, args.block_size, device, tokenizer,
                            not args.no_replay, stop, args.seed, args.release_kv)
            logger.info("batch %d: rollout path %.2fs for %d tokens, %.0f tok/s (first run %.2fs); decode step %s ms, host "
                        "gap %s (all steps %s), outside engine steps %s, device busy %s of the run", batch, r["s"],
                        r["tokens"], r["tokens"] / r["s"], r["first_s"], _num(r.get("decode_step_ms")),
                        _pct(r.get("decode_host_gap_share")), _pct(r.get("host_gap_share")), _pct(r["outside_share"]),
                        _pct(r["busy_share"]))
            logger.info("batch %d: rollout path ms per step by phase (launch includes the forward on CPU): %s", batch,
                        ", ".join(f"{k} {v:.2f}" for k, v in r["phase_ms"].items()))
            rollout_rows.append((batch, r))

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
        f"- prompts of {max(prompt_len // 2, 1)}-{prompt_len} tokens, {new_tokens} new tokens per request; "
        f"transformers `generate` (greedy, EOS ignored, one left-padded batch, {hf_impl}) at batch "
        f"{', '.join(map(str, sorted(hf_sizes))) or 'none'}; the embedded engine with block size {args.block_size}, "
        f"overlap scheduler {'on' if args.overlap else 'off'}, {args.decode_steps} decode step(s) a launch, index keys "
        f"cached as {args.index_key_cache_dtype}",
        f"- command: `{command}`",
        "",
    ]
    if rows:
        lines += [
            "Simple path (greedy, EOS ignored, all prompts added at once, the engine stepped directly):",
            "",
            "| batch | transformers tok/s | engine tok/s | engine / transformers | decode step ms | host gap (decode steps) | engine time in prefill | engine first run tok/s | engine without CUDA graphs tok/s | identical outputs | device busy |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *(f"| {b} | {_num(h, 1)} | {e:.1f} | {_ratio(e, h)} | {_num(pf.get('decode_step_ms'))} | {_pct(pf.get('decode_host_gap_share'))} "
              f"| {p:.0%} | {c:.1f} | {_num(g, 1)} | {_pct(sm)} | {_pct(pf['busy_share'])} |" for b, h, e, p, c, g, sm, pf in rows),
            "",
            "- engine tok/s: the second run of the batch through the same engine (an RL engine serves many batches);"
            " the first run also captures the CUDA graphs (CUDA only) and compiles kernels for new shapes.",
            "",
        ]
    if rollout_rows:
        lines += [
            f"Rollout path (groups of {args.group_size}, T=1 with a seed per sample, return_logprob, stop {stop}, "
            f"index replay rows {'off' if args.no_replay else 'on'}, prefix caching, through the server's /generate "
            "code in process; timed after a weight update):",
            "",
            "| batch | prompts x group | rollout tok/s | rollout / transformers | decode step ms | host gap (decode steps) | host gap (all steps) | steps | decode steps | time outside engine steps | first run tok/s | device busy |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *(f"| {b} | {b // args.group_size} x {args.group_size} | {r['tokens'] / r['s']:.1f} | {_ratio(r['tokens'] / r['s'], hf_tok_s.get(b))} "
              f"| {_num(r.get('decode_step_ms'))} | {_pct(r.get('decode_host_gap_share'))} | {_pct(r.get('host_gap_share'))} "
              f"| {r.get('steps', 0):.0f} | {r.get('decode_steps', 0):.0f} | {_pct(r['outside_share'])} | {r['first_tokens'] / r['first_s']:.1f} "
              f"| {_pct(r['busy_share'])} |"
              for b, r in rollout_rows),
            "",
            *(f"- batch {b}: the engine's host time per step by phase, ms (launch holds the forward on CPU): "
              + ", ".join(f"{k} {v:.2f}" for k, v in r["phase_ms"].items()) for b, r in rollout_rows),
            *(released_line(b, r) for b, r in rollout_rows if r.get("released")),
            "",
            "- rollout / transformers: against transformers' greedy tok/s at the same batch (other prompts; its speed does"
            " not depend on them). host gap: the share of time in engine steps the device is not working (on CUDA each"
            " step's device span from CUDA events; on CPU the model forward); time outside engine steps: the engine"
            " thread's polling, the /generate parsing and the response building (base64 top-k rows, texts); device"
            " busy: the device's time over the run's wall time (with overlap the device also works between steps).",
            "",
        ]
    lines += [
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


def released_line(batch: int, r: dict) -> str:
    """The --release-kv comparison of one batch: the same timed run with the KV cache kept, and released and
    re-allocated before it."""
    kept, released = r, r["released"]
    kept_tok_s, released_tok_s = kept["tokens"] / kept["s"], released["tokens"] / released["s"]
    return (f"- batch {batch}, KV cache released and re-allocated before the run (a colocated RL step's hand-over): "
            f"{released['s']:.3f} s, {released_tok_s:.1f} tok/s, against {kept['s']:.3f} s, {kept_tok_s:.1f} tok/s "
            f"kept ({kept_tok_s / released_tok_s:.2f}x); CUDA graphs captured in the run: "
            f"{released.get('graph_captures', 0):.0f} in {released.get('graph_capture_s', 0.0):.3f} s released, "
            f"{kept.get('graph_captures', 0):.0f} in {kept.get('graph_capture_s', 0.0):.3f} s kept")


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _ratio(ours: float, theirs: float | None) -> str:
    return "-" if not theirs else f"{ours / theirs:.2f}x"


if __name__ == "__main__":
    main()
