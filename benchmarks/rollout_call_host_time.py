r"""The host work of engine_throughput.py's rollout path on CPU, with the model's forward replaced by zeros.

What runs is the rollout path itself (engine_throughput.py's module docstring): groups of --group-size samples, one
/generate body per group parsed and answered by the server's code in process (rollout.server.in_process), an
AsyncEngine with the overlap scheduler, T=1 with a seed per sample, return_logprob, a stop string over a word
tokenizer, every row's DSA top-k for index replay from row 0, prefix caching, and a weight update before the timed
run. Only the forward is gone: it returns zero hidden states and zero top-k rows at once (as engine_host_time.py),
so the run is host work plus the sampling's and the replay rows' tensor ops, which a GPU would run.

The RL loop's call pattern (issue 19): --paths http sends the same calls over real HTTP, the embedded server
(rollout.server.launch.EmbeddedServer) on 127.0.0.1 in this process's event loop and the calls from a client process
(rollout_http_client.py, rollout.client.EngineClient), as the orchestrator sends them to the engine's Ray actor;
--call-form n (the default) sends each group's prompt once with n and the first seed, as the RL loop does to embedded
engines, per-sample one prompt per sample with its seed, as to SGLang, batch the n form's calls merged by the client
into batch bodies, as with rollout.coalesce_calls (same responses, all three); --lengths rl makes the
answers end at varied steps, ~19 tokens (answer_lengths says what is faked). --model-forward real
keeps the model's forward (--shape 300m: engine_throughput.py's 300m preset), so --device cuda measures the same
on a GPU; its numerics depend on which requests share a step, so its digests may differ between paths and runs.

Per batch and path: the timed run's wall time; the CPU time of the event loop's thread (parsing, admission calls,
responses) and of the engine thread (steps, commands), and of the client process over HTTP; the wall time in engine
steps and the engine thread's CPU time in them (the rest it waited: for the GIL, or for a core), before the first
step and after the last one (the device idles there on a GPU); the mean decode step, its host part and host gap
share (the engine's own stats, as perf/engine_decode_* in the RL loop); the garbage collector's time in each thread;
of the event loop's CPU time, that of building the responses (protocol.build_response) and of it the replay rows'
base64 (encode_int32); the engine's host phases per step; and a digest of the responses (every field but the rid,
the latency and cached_tokens, which moves with when a group's requests reach the engine).

--shape 300m gives the responses the 300m preset's sizes on the H200 (index_topk 256, 4 full layers, prompts of
128-256 tokens, 128 new tokens); the vocabulary stays the tiny preset's, so sampling on the CPU stays small.
--baseline-tree runs the same measurement with another checkout's code in child processes (baseline_tree.py),
alternating with this tree's, and reports both and whether their responses were the same. --profile-loop and
--profile-engine write cProfile stats of the event loop's thread and of the engine's steps.

    PYTHONPATH=$PWD python benchmarks/rollout_call_host_time.py --shape 300m --batch-sizes 256,1024
    PYTHONPATH=$PWD python benchmarks/rollout_call_host_time.py --shape 300m --baseline-tree /tmp/base --rounds 3
    PYTHONPATH=$PWD python benchmarks/rollout_call_host_time.py --batch-sizes 1024 --lengths rl --no-replay \
        --paths inprocess,http
    PYTHONPATH=$PWD python benchmarks/rollout_call_host_time.py --batch-sizes 256,1024 --lengths rl --no-replay \
        --paths http --call-form per-sample
    PYTHONPATH=$PWD python benchmarks/rollout_call_host_time.py --batch-sizes 256,1024 --lengths rl --no-replay \
        --paths http --call-form n,batch
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import json
import logging
import math
import random
import statistics
import sys
import threading
import time
import types
from pathlib import Path

import torch

import sync_sites  # beside this script
import trace_steps  # beside this script
import baseline_tree  # beside this script (sys.path[0]): a child on a baseline tree imports this tree's copy
import rollout  # the tree under test (PYTHONPATH; a child: the baseline tree) before engine_throughput puts this
from rollout.engine import AsyncEngine, Engine  # checkout first on the path: its imports then find these modules
from rollout.server import protocol
from rollout.server.in_process import InProcessClient
from slime_dsa.checkpoint import build_model
from slime_dsa.models import ModelConfig

import engine_throughput as et  # noqa: E402, I001
import rollout_http_client  # noqa: E402, I001
from rollout_http_client import digest  # noqa: E402, I001

logger = logging.getLogger("rollout_call_host_time")
SHAPES = {  # name: (config overrides of the tiny preset, longest prompt, new tokens)
    "tiny": ({}, 24, 64),
    "300m": ({"index_topk": 256, "num_hidden_layers": 8}, 256, 128),
}
responses, base64 = [0.0], [0.0]  # thread CPU seconds in protocol.build_response and, of it, encode_int32
FIGURES = ("wall_ms", "main_cpu_ms", "engine_cpu_ms", "decode_step_ms", "decode_host_ms", "in_steps_ms",
           "in_steps_engine_cpu_ms", "before_first_step_ms", "after_last_step_ms",
           "responses_cpu_ms", "replay_base64_cpu_ms")


def zero_forward(model) -> None:
    """model.forward_packed returns zero hidden states (and zero top-k rows when asked) without computing."""
    config, n_full = model.config, len(model.config.full_layer_ids)

    def forward_packed(ids, batch, return_logits=False, return_topk=False):
        rows = ids.shape[0]
        topk = torch.zeros(n_full, rows, config.index_topk, dtype=torch.long) if return_topk else None
        return types.SimpleNamespace(hidden_states=torch.zeros(rows, config.hidden_size), topk_indices=topk)

    model.forward_packed = forward_packed


def _timed_steps(engine: Engine, profile: cProfile.Profile | None = None,
                 windows: list[tuple[int, int, bool]] | None = None) -> list[float]:
    """Record [first step's start, last step's end, engine thread CPU seconds in steps] of the engine from now on
    (an instance wrapper of step); with `profile`, profile the steps; with `windows`, append each step's (start ns,
    end ns, decode-only) on the wall clock, which torch.profiler's traces use (trace_steps.summarize)."""
    span: list[float] = []
    step = engine.step

    def timed():
        start, cpu, wall_ns = time.perf_counter(), time.thread_time(), time.time_ns()
        if profile:
            profile.enable()
        decodes = engine.stats["decode_steps"]
        try:
            return step()
        finally:
            if profile:
                profile.disable()
            if windows is not None:
                windows.append((wall_ns, time.time_ns(), engine.stats["decode_steps"] > decodes))
            span[:] = [span[0] if span else start, time.perf_counter(),
                       (span[2] if span else 0.0) + time.thread_time() - cpu]

    engine.step = timed
    return span


class _GcTimer:
    """Wall ms of the garbage collector's passes, by the thread that ran them (the engine's or the event loop's)."""

    def __init__(self) -> None:
        self.ms = {"engine": 0.0, "loop": 0.0}
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            where = "loop" if threading.current_thread() is threading.main_thread() else "engine"
            self.ms[where] += (time.perf_counter() - self._start) * 1e3

    def __enter__(self) -> "_GcTimer":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


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


def answer_lengths(n: int, cap: int, seed: int) -> list[int]:
    """--lengths rl: each sample's max_new_tokens, from N(19, 4), at least 4 and at most `cap`, as the RL loop's
    answers (vs_trl.py on the H200: ~19 tokens, ~26 decode steps); at seed 0 and batch 1024 a group's longest is 22-33.
    FAKE: the zero forward samples uniformly and never says EOS or the stop string; a per-sample token cap makes
    samples end at varied steps through the engine's same finish path (finish_reason length instead of stop)."""
    rng = random.Random(seed)
    return [min(cap, max(4, round(rng.gauss(19, 4)))) for _ in range(n)]


def cap_by_seed(front: AsyncEngine, caps: list[int], batch: int) -> None:
    """--lengths rl: each request's max_new_tokens is caps[its sampling_seed % batch] (seeds run * batch + sample), set
    once the server has parsed its call. FAKE, with answer_lengths: the calls carry one max_new_tokens for every
    sample, as the RL loop's do, so a group's call can take either form."""
    finals = front.finals

    async def capped(requests):
        for req in requests:
            req.sampling.max_new_tokens = caps[req.sampling.sampling_seed % batch]
        return await finals(requests)

    front.finals = capped


async def run_batch(model, tokenizer, batch: int, args: argparse.Namespace) -> dict:
    """One engine through a first run, a weight update and the timed run of `batch` requests: its figures."""
    _, prompt_len, new_tokens = SHAPES[args.shape]
    group = args.group_size
    prompts = et.make_prompts(batch // group, prompt_len, model.config.vocab_size, args.seed + batch)
    need = sum(-(-(len(p) + new_tokens) // 16) for p in prompts) * group * 16
    engine = Engine(model, max_cache_tokens=need + 16, max_running_requests=batch, block_size=16, tokenizer=tokenizer,
                    keep_indexer_topk=not args.no_replay, overlap=True, seed=args.seed)
    front = AsyncEngine(engine) if args.gather_ms is None else AsyncEngine(engine, gather_ms=args.gather_ms)
    await front.start()
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop": ["</answer>"]}
    if args.lengths == "rl":
        cap_by_seed(front, answer_lengths(batch, new_tokens, args.seed), batch)
    send = await _sender(front, tokenizer, args)

    def groups_of(run: int) -> list:
        return [[p, [{**params, "sampling_seed": run * batch + g * group + k} for k in range(group)]]
                for g, p in enumerate(prompts)]

    try:
        await send.digest(await (await send(0, groups_of(0)))())
        await front.update_weights({k: v.clone() for k, v in model.state_dict().items()}, weight_version="1")
        go = await send(1, groups_of(1))
        stats = dict(engine.stats)
        engine_cpu = await front._call(time.thread_time)
        engine_profile = cProfile.Profile() if args.profile_engine else None
        windows: list[tuple[int, int, bool]] | None = [] if args.torch_trace or args.sync_sites else None
        span = _timed_steps(engine, engine_profile, windows)
        tracer = _torch_tracer(args)
        syncs = sync_sites.SyncSites() if args.sync_sites else contextlib.nullcontext()
        responses[0] = base64[0] = 0.0
        main_cpu, start = time.thread_time(), time.perf_counter()
        profile = cProfile.Profile() if args.profile_loop else None
        if profile:
            profile.enable()
        with _GcTimer() as gc_timer, tracer, syncs:
            done = await go()
        if profile:
            profile.disable()
            profile.dump_stats(f"{args.profile_loop}.{batch}.{args.path}")
        if engine_profile:
            engine_profile.dump_stats(f"{args.profile_engine}.{batch}.{args.path}")
        wall, main_cpu = time.perf_counter() - start, time.thread_time() - main_cpu
        engine_cpu = await front._call(time.thread_time) - engine_cpu
        done["digest"] = await send.digest(done)
    finally:
        await send.close()
        await front.stop()
    d = {k: engine.stats[k] - stats.get(k, 0) for k in engine.stats}
    trace = None
    if args.torch_trace:
        path = f"{args.torch_trace}.{batch}.{args.path}.json.gz"
        tracer.export_chrome_trace(path)
        trace = trace_steps.summarize(path, windows)
    steps, decode_steps = max(d["steps"], 1), max(d["decode_steps"], 1)
    return {"wall_ms": wall * 1e3, "main_cpu_ms": main_cpu * 1e3, "engine_cpu_ms": engine_cpu * 1e3,
            "in_steps_ms": d["step_s"] * 1e3, "in_steps_engine_cpu_ms": span[2] * 1e3,
            "before_first_step_ms": (span[0] - start) * 1e3,
            "after_last_step_ms": (start + wall - span[1]) * 1e3, "steps": d["steps"], "commands": d["commands"],
            "decode_steps": d["decode_steps"], "decode_step_ms": d["decode_step_s"] / decode_steps * 1e3,
            "decode_host_ms": (d["decode_step_s"] - d["decode_device_s"]) / decode_steps * 1e3,
            "decode_host_gap_share": 1 - d["decode_device_s"] / max(d["decode_step_s"], 1e-9),
            "phase_ms": {k.removesuffix("_s"): d[k] / steps * 1e3 for k in et.HOST_PHASES},
            "engine_gc_ms": gc_timer.ms["engine"], "loop_gc_ms": gc_timer.ms["loop"],
            "responses_cpu_ms": responses[0] * 1e3, "replay_base64_cpu_ms": base64[0] * 1e3,
            "tokens": d["generated_tokens"], "digest": done["digest"], "client_wall_ms": done["wall_s"] * 1e3,
            "client_cpu_ms": done.get("cpu_s", float("nan")) * 1e3,
            "tree": str(Path(rollout.__file__).parents[1]), **({"trace": trace} if trace else {}),
            **({"sync_sites": syncs.summary(windows)} if args.sync_sites else {})}


def _torch_tracer(args: argparse.Namespace):
    """A torch.profiler over the timed run with --torch-trace (CUDA kernels on a GPU), else a no-op context."""
    if not args.torch_trace:
        return contextlib.nullcontext()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


async def _sender(front: AsyncEngine, tokenizer, args: argparse.Namespace):
    """send(run, groups) -> go(), and go() -> {"wall_s", ...}: every group's call at once, in process (InProcessClient)
    or, with --paths http, through the embedded server on 127.0.0.1 from a client process (rollout_http_client.py),
    which got the groups in send(). send.digest(go's result): the responses' digest, after the timing; send.close()."""
    def spec(run: int, groups: list) -> dict:
        return {"run": run, "groups": groups, "return_logprob": not args.no_logprob, "replay": not args.no_replay,
                "form": args.call_form}

    if args.path == "inprocess":
        client = InProcessClient(front, tokenizer)

        async def send(run: int, groups: list):
            async def go() -> dict:
                done = await rollout_http_client.run(spec(run, groups), client)  # digested after the timing
                del done["cpu_s"]  # the whole process's here: no client process of its own
                return done
            return go

        async def groups_digest(done: dict) -> str:
            return digest(done.pop("groups"))

        send.close, send.digest = _nothing, groups_digest
        return send
    from rollout.server.launch import EmbeddedServer  # noqa: PLC0415

    server = await EmbeddedServer.start(front, tokenizer, max_body_bytes=1 << 30)
    child = await asyncio.create_subprocess_exec(
        sys.executable, str(Path(rollout_http_client.__file__).resolve()), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, limit=1 << 20)

    async def line(text: bytes) -> bytes:
        child.stdin.write(text + b"\n")
        await child.stdin.drain()
        answer = await child.stdout.readline()
        if not answer:
            raise RuntimeError(f"the HTTP client process ended (exit code {await child.wait()})")
        return answer

    async def send(run: int, groups: list):
        await line(json.dumps({"url": server.url, **spec(run, groups)}).encode())  # "ready"

        async def go() -> dict:
            return json.loads(await line(b"go"))
        return go

    async def read_digest(done: dict) -> str:
        return json.loads(await child.stdout.readline())["digest"]  # the client's second line

    async def close() -> None:
        child.stdin.close()
        await child.wait()
        await server.stop()

    send.close, send.digest = close, read_digest
    return send


async def _nothing() -> None:
    pass


def measure(args: argparse.Namespace) -> dict[str, dict]:
    """run_batch at each batch size and call path in this process: {"<batch>" or "<batch> http": figures}."""
    torch.set_num_threads(1)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    device = torch.device(args.device)
    overrides, _, _ = SHAPES[args.shape]
    if args.model_forward == "real":  # the model of engine_throughput.py's preset (300m: the H200's engthr stage)
        config = et.model_config("300m" if args.shape == "300m" else "tiny")
    else:
        config = ModelConfig.from_dict({**et._COMMON, **et.PRESETS["tiny"][0], **overrides})
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(config, dtype=dtype, device=device, seed=args.seed).eval()
    if args.model_forward == "zero":
        zero_forward(model)
    _cpu_timed(protocol, "build_response", responses)  # the event loop's part of answering (in_process calls these)
    _cpu_timed(protocol, "encode_int32", base64)
    tokenizer = et.word_tokenizer(config.vocab_size)
    results = {}
    for b in args.batches:
        for path in args.paths:
            for form in args.call_forms:  # several: in turn, each batch size's forms side by side
                args.path, args.call_form = path, form
                key = str(b) if path == "inprocess" else f"{b} {path}"
                key += f" {form}" if len(args.call_forms) > 1 else ""
                results[key] = asyncio.run(run_batch(model, tokenizer, b, args))
    return results


def _figures(row: dict) -> tuple[str, ...]:
    """FIGURES, and over HTTP the client process's wall and CPU time too."""
    return FIGURES + (() if math.isnan(row["client_cpu_ms"]) else ("client_wall_ms", "client_cpu_ms"))


def compare(args: argparse.Namespace) -> dict:
    """Alternate the baseline tree and this one in child processes; medians per batch and figure."""
    rounds = baseline_tree.alternate(__file__, args.forward, args.baseline_tree, args.rounds)
    for r, pair in enumerate(rounds):
        for b in pair["this"]:
            logger.info("round %d, batch %s: %s; same responses: %s", r + 1, b, ", ".join(
                f"{f} {pair['baseline'][b][f]:.0f} -> {pair['this'][b][f]:.0f}" for f in _figures(pair["this"][b])),
                pair["baseline"][b]["digest"] == pair["this"][b]["digest"])
    summary = {}
    for b in rounds[0]["this"]:
        summary[b] = {side: {f: statistics.median(r[side][b][f] for r in rounds) for f in _figures(rounds[0]["this"][b])}
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
    parser.add_argument("--paths", default="inprocess",
                        help="comma list of inprocess | http (the embedded server on 127.0.0.1, the calls from a "
                             "client process: the RL loop's); each batch size runs on each path")
    parser.add_argument("--lengths", choices=("fixed", "rl"), default="fixed",
                        help="rl: answers end at varied steps, ~19 tokens (answer_lengths; faked by a token cap)")
    parser.add_argument("--call-form", default="n",
                        help="a group's call, a comma list of forms (each batch size runs each in turn): n, the prompt "
                             "once with n and the first seed (the RL loop's to embedded engines without "
                             "rollout.coalesce_calls); batch, the same calls merged by the client into batch bodies "
                             "of up to 64 samples (rollout.coalesce_calls; --paths http only), batch:N up to N; "
                             "per-sample, one prompt per sample with its seed (its form for SGLang)")
    parser.add_argument("--profile-loop", default=None, metavar="FILE",
                        help="cProfile the event loop's thread over the timed run into FILE.<batch>.<path>")
    parser.add_argument("--gather-ms", type=float, default=None,
                        help="AsyncEngine's gather_ms (default: its own): how long an idle engine waits for the next "
                             "call of a burst before its first step")
    parser.add_argument("--torch-trace", default=None, metavar="PREFIX",
                        help="torch.profiler over the timed run: PREFIX.<batch>.<path>.json.gz (Chrome trace) and, in "
                             "the figures, the GPU-busy share per step kind and the top kernels (trace_steps.py)")
    parser.add_argument("--sync-sites", action="store_true",
                        help="on CUDA, count the timed run's host syncs by the code that made them and by engine step "
                             "kind (sync_sites.py; its warnings slow the run, so its times are not comparable)")
    parser.add_argument("--profile-engine", default=None, metavar="FILE",
                        help="cProfile the engine thread's steps over the timed run into FILE.<batch>.<path>")
    parser.add_argument("--model-forward", choices=("zero", "real"), default="zero",
                        help="real: the model computes (--shape 300m: engine_throughput.py's 300m preset)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda needs --model-forward real")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval in the engine's process (default: Python's, 0.005 s)")
    parser.add_argument("--seed", type=int, default=0)
    args = baseline_tree.parse(parser, argv)
    args.batches = [int(b) for b in args.batch_sizes.split(",")]
    if any(b % args.group_size for b in args.batches):
        parser.error(f"--batch-sizes must be multiples of --group-size ({args.group_size})")
    args.paths = args.paths.split(",")
    if not set(args.paths) <= {"inprocess", "http"}:
        parser.error(f"--paths takes inprocess and http, got {','.join(args.paths)}")
    args.call_forms = args.call_form.split(",")
    if not all(f in ("n", "batch", "per-sample") or f.startswith("batch:") for f in args.call_forms):
        parser.error(f"--call-form takes n, batch and per-sample, got {args.call_form}")
    if any(f.startswith("batch") for f in args.call_forms) and args.paths != ["http"]:
        parser.error("--call-form batch merges the calls in EngineClient: it needs --paths http")
    if args.device == "cuda" and args.model_forward != "real":
        parser.error("--device cuda needs --model-forward real (the zero forward makes CPU tensors)")
    logging.getLogger("rollout").setLevel(logging.WARNING)
    if baseline_tree.answered_as_child(args, measure):
        return {}
    result = {"this": measure(args)} if args.baseline_tree is None else compare(args)
    if "median" in result:
        for b, m in result["median"].items():
            logger.info("batch %s, medians of %d rounds, baseline -> this: %s; same responses in every round: %s", b,
                        args.rounds, ", ".join(f"{f} {m['baseline'][f]:.0f} -> {m['this'][f]:.0f}"
                                               for f in m["this"]),
                        m["same_responses"])
    else:
        for b, r in result["this"].items():
            logger.info("batch %s: %s", b, json.dumps(r))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
