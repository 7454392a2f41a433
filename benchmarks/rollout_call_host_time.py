"""The host work of engine_throughput.py's rollout path on CPU, with the model's forward replaced by zeros.

What runs is the rollout path itself (engine_throughput.py's module docstring): groups of --group-size samples, one
/generate body per group parsed and answered by the server's code in process (rollout.server.in_process), an
AsyncEngine with the overlap scheduler, T=1 with a seed per sample, return_logprob, a stop string over a word
tokenizer, every row's DSA top-k for index replay from row 0, prefix caching, and a weight update before the timed
run. Only the forward is gone: it returns zero hidden states and zero top-k rows at once (as engine_host_time.py),
so the run is host work plus the sampling's and the replay rows' tensor ops, which a GPU would run.

Per batch: the timed run's wall time; the CPU time of the event loop's thread (parsing, admission calls, responses)
and of the engine thread (steps, commands); the wall time in engine steps, before the first step and after the last
one (the device idles there on a GPU); of the event loop's CPU time, that of building the responses
(protocol.build_response) and of it the replay rows' base64 (encode_int32); the engine's host phases per step; and a
digest of the responses (every field but the rid, the latency and cached_tokens, which moves with when a group's
requests reach the engine).

--shape 300m gives the responses the 300m preset's sizes on the H200 (index_topk 256, 4 full layers, prompts of
128-256 tokens, 128 new tokens); the vocabulary stays the tiny preset's, so sampling on the CPU stays small.
--baseline-tree runs the same measurement with another checkout's code in child processes (baseline_tree.py),
alternating with this tree's, and reports both and whether their responses were the same.

    PYTHONPATH=$PWD python benchmarks/rollout_call_host_time.py --shape 300m --batch-sizes 256,1024
    PYTHONPATH=$PWD python benchmarks/rollout_call_host_time.py --shape 300m --baseline-tree /tmp/base --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import statistics
import time
import types
from pathlib import Path

import torch

import baseline_tree  # beside this script (sys.path[0]): a child on a baseline tree imports this tree's copy
import rollout  # the tree under test (PYTHONPATH; a child: the baseline tree) before engine_throughput puts this
from rollout.engine import AsyncEngine, Engine  # checkout first on the path: its imports then find these modules
from rollout.server import protocol
from rollout.server.in_process import InProcessClient
from slime_dsa.checkpoint import build_model
from slime_dsa.models import ModelConfig

import engine_throughput as et  # noqa: E402, I001

logger = logging.getLogger("rollout_call_host_time")
SHAPES = {  # name: (config overrides of the tiny preset, longest prompt, new tokens)
    "tiny": ({}, 24, 64),
    "300m": ({"index_topk": 256, "num_hidden_layers": 8}, 256, 128),
}
responses, base64 = [0.0], [0.0]  # thread CPU seconds in protocol.build_response and, of it, encode_int32
FIGURES = ("wall_ms", "main_cpu_ms", "engine_cpu_ms", "in_steps_ms", "before_first_step_ms", "after_last_step_ms",
           "responses_cpu_ms", "replay_base64_cpu_ms")


def zero_forward(model) -> None:
    """model.forward_packed returns zero hidden states (and zero top-k rows when asked) without computing."""
    config, n_full = model.config, len(model.config.full_layer_ids)

    def forward_packed(ids, batch, return_logits=False, return_topk=False):
        rows = ids.shape[0]
        topk = torch.zeros(n_full, rows, config.index_topk, dtype=torch.long) if return_topk else None
        return types.SimpleNamespace(hidden_states=torch.zeros(rows, config.hidden_size), topk_indices=topk)

    model.forward_packed = forward_packed


def _timed_steps(engine: Engine) -> list[float]:
    """Record [first step's start, last step's end] of the engine from now on (an instance wrapper of step)."""
    span: list[float] = []
    step = engine.step

    def timed():
        start = time.perf_counter()
        try:
            return step()
        finally:
            span[:] = [span[0] if span else start, time.perf_counter()]

    engine.step = timed
    return span


def _cpu_timed(owner: object, name: str, total: list[float]) -> None:
    """Add the thread CPU time of every call of owner.name to total[0]."""
    inner = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            total[0] += time.thread_time() - start

    setattr(owner, name, timed)


def digest(groups: list[list[dict]]) -> str:
    """sha256 of the responses, without the fields that change from run to run (rid, latency, cached_tokens)."""
    skip = {"id", "e2e_latency", "cached_tokens"}
    rows = [{**r, "meta_info": {k: v for k, v in r["meta_info"].items() if k not in skip}} for g in groups for r in g]
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]


async def run_batch(model, tokenizer, batch: int, args: argparse.Namespace) -> dict:
    """One engine through a first run, a weight update and the timed run of `batch` requests: its figures."""
    _, prompt_len, new_tokens = SHAPES[args.shape]
    group = args.group_size
    prompts = et.make_prompts(batch // group, prompt_len, model.config.vocab_size, args.seed + batch)
    need = sum(-(-(len(p) + new_tokens) // 16) for p in prompts) * group * 16
    engine = Engine(model, max_cache_tokens=need + 16, max_running_requests=batch, block_size=16, tokenizer=tokenizer,
                    keep_indexer_topk=not args.no_replay, overlap=True, seed=args.seed)
    front = AsyncEngine(engine)
    await front.start()
    client = InProcessClient(front, tokenizer)
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop": ["</answer>"]}

    async def once(run: int) -> list[list[dict]]:
        return await asyncio.gather(*(
            client.generate_batch([p] * group, [{**params, "sampling_seed": run * batch + g * group + k}
                                                for k in range(group)],
                                  return_logprob=not args.no_logprob, session_id=f"group-{run}-{g}",
                                  return_indexer_topk=not args.no_replay, indexer_topk_start_len=0)
            for g, p in enumerate(prompts)))

    try:
        await once(0)
        await front.update_weights({k: v.clone() for k, v in model.state_dict().items()}, weight_version="1")
        stats = dict(engine.stats)
        engine_cpu = await front._call(time.thread_time)
        span = _timed_steps(engine)
        responses[0] = base64[0] = 0.0
        main_cpu, start = time.thread_time(), time.perf_counter()
        groups = await once(1)
        wall, main_cpu = time.perf_counter() - start, time.thread_time() - main_cpu
        engine_cpu = await front._call(time.thread_time) - engine_cpu
    finally:
        await front.stop()
    d = {k: engine.stats[k] - stats.get(k, 0) for k in engine.stats}
    steps = max(d["steps"], 1)
    return {"wall_ms": wall * 1e3, "main_cpu_ms": main_cpu * 1e3, "engine_cpu_ms": engine_cpu * 1e3,
            "in_steps_ms": d["step_s"] * 1e3, "before_first_step_ms": (span[0] - start) * 1e3,
            "after_last_step_ms": (start + wall - span[1]) * 1e3, "steps": d["steps"], "commands": d["commands"],
            "phase_ms": {k.removesuffix("_s"): d[k] / steps * 1e3 for k in et.HOST_PHASES},
            "responses_cpu_ms": responses[0] * 1e3, "replay_base64_cpu_ms": base64[0] * 1e3,
            "tokens": d["generated_tokens"], "digest": digest(groups), "tree": str(Path(rollout.__file__).parents[1])}


def measure(args: argparse.Namespace) -> dict[str, dict]:
    """run_batch at each batch size in this process: {batch: figures}."""
    torch.set_num_threads(1)
    overrides, _, _ = SHAPES[args.shape]
    config = ModelConfig.from_dict({**et._COMMON, **et.PRESETS["tiny"][0], **overrides})
    model = build_model(config, dtype=torch.float32, device=torch.device("cpu"), seed=args.seed).eval()
    zero_forward(model)
    _cpu_timed(protocol, "build_response", responses)  # the event loop's part of answering (in_process calls these)
    _cpu_timed(protocol, "encode_int32", base64)
    tokenizer = et.word_tokenizer(config.vocab_size)
    return {str(b): asyncio.run(run_batch(model, tokenizer, b, args)) for b in args.batches}


def compare(args: argparse.Namespace) -> dict:
    """Alternate the baseline tree and this one in child processes; medians per batch and figure."""
    rounds = baseline_tree.alternate(__file__, args.forward, args.baseline_tree, args.rounds)
    for r, pair in enumerate(rounds):
        for b in pair["this"]:
            logger.info("round %d, batch %s: %s; same responses: %s", r + 1, b, ", ".join(
                f"{f} {pair['baseline'][b][f]:.0f} -> {pair['this'][b][f]:.0f}" for f in FIGURES),
                pair["baseline"][b]["digest"] == pair["this"][b]["digest"])
    summary = {}
    for b in rounds[0]["this"]:
        summary[b] = {side: {f: statistics.median(r[side][b][f] for r in rounds) for f in FIGURES}
                      for side in ("baseline", "this")}
        summary[b]["same_responses"] = all(r["baseline"][b]["digest"] == r["this"][b]["digest"] for r in rounds)
    return {"rounds": rounds, "median": summary}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="300m")
    parser.add_argument("--batch-sizes", default="256,1024")
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--no-replay", action="store_true", help="no DSA top-k rows for index replay")
    parser.add_argument("--no-logprob", action="store_true", help="return_logprob off")
    parser.add_argument("--seed", type=int, default=0)
    args = baseline_tree.parse(parser, argv)
    args.batches = [int(b) for b in args.batch_sizes.split(",")]
    if any(b % args.group_size for b in args.batches):
        parser.error(f"--batch-sizes must be multiples of --group-size ({args.group_size})")
    logging.getLogger("rollout").setLevel(logging.WARNING)
    if baseline_tree.answered_as_child(args, measure):
        return {}
    result = {"this": measure(args)} if args.baseline_tree is None else compare(args)
    if "median" in result:
        for b, m in result["median"].items():
            logger.info("batch %s, medians of %d rounds, baseline -> this: %s; same responses in every round: %s", b,
                        args.rounds, ", ".join(f"{f} {m['baseline'][f]:.0f} -> {m['this'][f]:.0f}" for f in FIGURES),
                        m["same_responses"])
    else:
        for b, r in result["this"].items():
            logger.info("batch %s: %s", b, json.dumps(r))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
