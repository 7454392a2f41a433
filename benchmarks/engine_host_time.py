"""The engine's host work per step on the rollout path's requests, with the model's forward replaced by zeros.

engine_throughput.py on CPU runs the forward on the engine's thread, where it takes ~95% of a step and varies with the
machine's load more than the host work does. Here the forward returns zero hidden states and top-k rows at once, so
a step is host work plus the sampling's tensor ops on (B, vocab) logits. Those ops, lm_head, the kept top-k stores and
the decode batch's tensors (device work on a GPU, the last inside its CUDA graph) are timed apart as `compute`; `launch - compute` is the launch phase's host work. Every figure
is the engine thread's CPU time (time.thread_time), so other processes on the machine do not count.

Requests as engine_throughput.py's rollout path sends them: groups of --group-size samples of one prompt, T=1 with a
seed per sample, return_logprob, a stop string over a word tokenizer, every row's DSA top-k kept for index replay
from row 0, non-streaming. The tokens are those of zero hidden states (the tiny preset's lm_head on zeros): uniform
over its 512 ids, so about 2 of 1,024 requests draw EOS each step and the batch changes nearly every step;
--ignore-eos keeps it the same until every request ends by length (as the 300m preset's 32,000 ids nearly do on the
GPU).

    python benchmarks/engine_host_time.py --batch 1024 --reps 2

--count-ops counts the ATen ops (on a GPU: one kernel launch each, views aside) that one more engine issues per decode
step, by where they come from (the innermost instrumented function; `decode graph` is inside the CUDA graph on a GPU),
and lists the most frequent ones. It runs apart from the timed engines: the counting slows the host.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import types
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_throughput as et  # noqa: E402
from rollout_call_host_time import zero_forward  # noqa: E402
from rollout.engine import GenerateRequest, SamplingParams  # noqa: E402
from rollout.engine import engine as engine_module  # noqa: E402
from rollout.engine import decode, kv_cache, rows, sample_graph  # noqa: E402
from slime_dsa.checkpoint import build_model  # noqa: E402
from slime_dsa.models import ModelConfig  # noqa: E402

logger = logging.getLogger("engine_host_time")
PHASES = ("schedule", "launch", "resolve", "stop_strings", "finish")
clock = time.thread_time
_compute = [0.0]
_where: list[str] = ["step"]  # the innermost instrumented function running, for --count-ops
# Where each op is counted: the engine's phases, and inside them the parts timed as `compute`.
_PLACES = {"_schedule": "schedule", "_launch": "launch (other)", "_resolve": "resolve", "_sampling_rows": "rows update",
           "_feed": "feed inputs", "forward": "decoder inputs", "_run": "decode graph", "sample": "sample",
           "uniforms": "uniforms", "finish_codes": "finish codes", "mask_stop_ids": "mask stop ids",
           "store_topk": "store topk", "lm_head": "lm_head"}


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops run under it by (place, op); views (no kernel on a GPU) apart."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[tuple[str, str]] = Counter()
        self.views: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # aten.to is an aliasing op in the schema but copies when the dtype changes: judged by the storage.
        first = out[0] if isinstance(out, (tuple, list)) and out else out  # unbind, split: views of one storage
        if func.is_view and isinstance(first, torch.Tensor) and args and isinstance(args[0], torch.Tensor) and (
                first.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()):
            self.views[_where[-1]] += 1
        else:
            self.ops[(_where[-1], str(func.overloadpacket.__name__))] += 1
        return out


def _placed(owner: object, name: str, place: str) -> None:
    """Label the ops run inside owner.name with `place`."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        _where.append(place)
        try:
            return inner(*args, **kwargs)
        finally:
            _where.pop()

    setattr(owner, name, wrapper)


def _timed(owner: object, name: str) -> None:
    """Count the time in owner.name into `compute`."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = clock()
        try:
            return inner(*args, **kwargs)
        finally:
            _compute[0] += clock() - start

    setattr(owner, name, wrapper)


def _instrument(model) -> None:
    """The engine's phase timers on thread CPU time; sampling, lm_head and top-k stores into `compute`; no forward."""
    engine_module.time = types.SimpleNamespace(perf_counter=clock)  # Engine.stats' phases are perf_counter spans
    _timed(decode.PagedDecoder, "_run")  # the decode batch's tensors: inside the CUDA graph on a GPU
    _timed(sample_graph, "sample")  # the draw itself, inside sample_graph.sample_rows
    for name in ("uniforms", "finish_codes", "mask_stop_ids"):
        _timed(rows.SamplingRows, name)
    _timed(kv_cache.PagedKVCache, "store_topk")
    for owner, names in ((engine_module.Engine, ("_schedule", "_launch", "_resolve", "_sampling_rows", "_feed")),
                         (decode.PagedDecoder, ("forward", "_run")), (sample_graph, ("sample",)),
                         (rows.SamplingRows, ("uniforms", "finish_codes", "mask_stop_ids")),
                         (kv_cache.PagedKVCache, ("store_topk",))):
        for name in names:
            _placed(owner, name, _PLACES[name])
    started = [0.0]

    def lm_head_start(*_) -> None:
        started[0] = clock()
        _where.append("lm_head")

    def lm_head_end(*_) -> None:
        _compute[0] += clock() - started[0]
        _where.pop()

    model.lm_head.register_forward_pre_hook(lm_head_start)
    model.lm_head.register_forward_hook(lm_head_end)
    zero_forward(model)


def _engine(model, tokenizer, batch: int, group: int, new_tokens: int, seed: int, ignore_eos: bool,
            overlap: bool, decode_steps: int = 1) -> engine_module.Engine:
    """An engine holding `batch` requests of the rollout path, none stepped yet."""
    engine = engine_module.Engine(model, max_cache_tokens=(-(-(24 + new_tokens) // 16) * batch + 1) * 16,
                                  max_running_requests=batch, block_size=16, tokenizer=tokenizer, keep_indexer_topk=True,
                                  seed=seed, overlap=overlap, num_continuous_decode_steps=decode_steps)
    for g, prompt in enumerate(et.make_prompts(batch // group, 24, model.config.vocab_size, seed)):
        for k in range(group):
            params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, stop=["</answer>"], sampling_seed=g * group + k,
                                    ignore_eos=ignore_eos)
            engine.add_request(GenerateRequest(input_ids=prompt, sampling=params, rid=f"{g}-{k}", return_logprob=True,
                                               return_indexer_topk=True, indexer_topk_start_len=0, stream=False))
    return engine


def run_once(model, tokenizer, batch: int, group: int, new_tokens: int, seed: int, ignore_eos: bool = False,
             overlap: bool = False, decode_steps: int = 1) -> dict[str, float]:
    """One engine from empty to done over `batch` requests: ms of thread CPU time per step the device runs (with
    several decode steps a launch, fewer `Engine.step` calls than steps), by phase; `first step`: the first
    `Engine.step` call alone (every admission, the prompts' forward and the group samples' fork copies)."""
    engine = _engine(model, tokenizer, batch, group, new_tokens, seed, ignore_eos, overlap, decode_steps)
    _compute[0], start = 0.0, clock()
    engine.step()  # the admissions of every request, the prompts' prefill and the forks' copies
    first_step = clock() - start
    while engine.has_work:
        engine.step()
    steps = engine.stats["steps"]  # forward steps, each of a launch of several counted
    ms = {name: engine.stats[f"{name}_s"] / steps * 1e3 for name in PHASES}
    ms["compute"] = _compute[0] / steps * 1e3
    ms["launch - compute"] = ms["launch"] - ms["compute"]
    ms["step"] = (clock() - start) / steps * 1e3
    ms["step - compute"] = ms["step"] - ms["compute"]
    ms["first step"] = first_step * 1e3
    return ms


def count_ops(model, tokenizer, batch: int, group: int, new_tokens: int, ignore_eos: bool = False,
              overlap: bool = False) -> None:
    """Log the ATen ops per decode step of one engine from empty to done, by place, and the most frequent ones."""
    engine = _engine(model, tokenizer, batch, group, new_tokens, 0, ignore_eos, overlap)
    per_step, views, steps, changed = Counter(), Counter(), 0, 0
    while engine.has_work:
        decodes, key = engine.stats["paged_decode_steps"], engine._rows.key if engine._rows is not None else None
        with OpCounter() as counter:
            engine.step()
        if engine.stats["paged_decode_steps"] > decodes:
            per_step.update(counter.ops)
            views.update(counter.views)
            steps += 1
            changed += engine._rows.key != key
    by_place = Counter()
    for (place, _), n in per_step.items():
        by_place[place] += n
    logger.info("batch %d: %.1f ATen ops (+ %.1f views) per decode step over %d decode steps (%d with a batch change)",
                batch, sum(per_step.values()) / steps, sum(views.values()) / steps, steps, changed)
    logger.info("by place: %s", ", ".join(f"{p} {n / steps:.1f}" for p, n in by_place.most_common()))
    logger.info("top ops: %s", ", ".join(f"{p}:{op} {n / steps:.1f}" for (p, op), n in per_step.most_common()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1024, help="requests, all running at once")
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2, help="fresh engines in a row; the median is printed too")
    parser.add_argument("--ignore-eos", action="store_true", help="requests end by length only (no batch changes)")
    parser.add_argument("--overlap", action="store_true", help="the engine's overlap scheduler (Engine(overlap=True))")
    parser.add_argument("--decode-steps", type=int, nargs="+", default=[1],
                        help="Engine(num_continuous_decode_steps=...): each value's engines run in turn, one rep each")
    parser.add_argument("--count-ops", action="store_true",
                        help="also count the ATen ops per decode step (one more engine)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    config = ModelConfig.from_dict({**et._COMMON, **et.PRESETS["tiny"][0]})
    model = build_model(config, dtype=torch.float32, device=torch.device("cpu"), seed=0).eval()
    _instrument(model)
    tokenizer = et.word_tokenizer(config.vocab_size)
    runs: dict[int, list[dict[str, float]]] = {steps: [] for steps in args.decode_steps}
    for rep in range(args.reps):  # the settings interleaved, so the machine's load drifts over all of them alike
        for steps, done in runs.items():
            done.append(run_once(model, tokenizer, args.batch, args.group_size, args.new_tokens, seed=rep,
                                 ignore_eos=args.ignore_eos, overlap=args.overlap, decode_steps=steps))
            logger.info("batch %d, %d decode steps a launch, run %d, ms per step: %s", args.batch, steps, rep,
                        ", ".join(f"{k} {v:.2f}" for k, v in done[-1].items()))
    for steps, done in runs.items():
        logger.info("batch %d, %d decode steps a launch, median ms per step: %s", args.batch, steps,
                    ", ".join(f"{k} {statistics.median(r[k] for r in done):.2f}" for k in done[0]))
    if args.count_ops:
        count_ops(model, tokenizer, args.batch, args.group_size, args.new_tokens, args.ignore_eos, args.overlap)


if __name__ == "__main__":
    main()
