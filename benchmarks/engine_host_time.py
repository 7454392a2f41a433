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
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_throughput as et  # noqa: E402
from rollout.engine import GenerateRequest, SamplingParams  # noqa: E402
from rollout.engine import engine as engine_module  # noqa: E402
from rollout.engine import decode, kv_cache, rows  # noqa: E402
from slime_dsa.checkpoint import build_model  # noqa: E402
from slime_dsa.models import ModelConfig  # noqa: E402

logger = logging.getLogger("engine_host_time")
PHASES = ("schedule", "launch", "resolve", "stop_strings", "finish")
clock = time.thread_time
_compute = [0.0]


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
    _timed(engine_module, "sample")
    for name in ("uniforms", "finish_codes", "mask_stop_ids"):
        _timed(rows.SamplingRows, name)
    _timed(kv_cache.PagedKVCache, "store_topk")
    started = [0.0]
    model.lm_head.register_forward_pre_hook(lambda *_: started.__setitem__(0, clock()))
    model.lm_head.register_forward_hook(lambda *_: _compute.__setitem__(0, _compute[0] + clock() - started[0]))
    config, n_full = model.config, len(model.config.full_layer_ids)

    def forward_packed(ids, batch, return_logits=False, return_topk=False):
        rows_ = ids.shape[0]
        topk = torch.zeros(n_full, rows_, config.index_topk, dtype=torch.long) if return_topk else None
        return types.SimpleNamespace(hidden_states=torch.zeros(rows_, config.hidden_size), topk_indices=topk)

    model.forward_packed = forward_packed


def run_once(model, tokenizer, batch: int, group: int, new_tokens: int, seed: int, ignore_eos: bool = False,
             overlap: bool = False) -> dict[str, float]:
    """One engine from empty to done over `batch` requests: ms of thread CPU time per step, by phase."""
    config = model.config
    engine = engine_module.Engine(model, max_cache_tokens=(-(-(24 + new_tokens) // 16) * batch + 1) * 16,
                                  max_running_requests=batch, block_size=16, tokenizer=tokenizer, keep_indexer_topk=True,
                                  seed=seed, overlap=overlap)
    for g, prompt in enumerate(et.make_prompts(batch // group, 24, config.vocab_size, seed)):
        for k in range(group):
            params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, stop=["</answer>"], sampling_seed=g * group + k,
                                    ignore_eos=ignore_eos)
            engine.add_request(GenerateRequest(input_ids=prompt, sampling=params, rid=f"{g}-{k}", return_logprob=True,
                                               return_indexer_topk=True, indexer_topk_start_len=0, stream=False))
    _compute[0], start, steps = 0.0, clock(), 0
    while engine.has_work:
        engine.step()
        steps += 1
    ms = {name: engine.stats[f"{name}_s"] / steps * 1e3 for name in PHASES}
    ms["compute"] = _compute[0] / steps * 1e3
    ms["launch - compute"] = ms["launch"] - ms["compute"]
    ms["step"] = (clock() - start) / steps * 1e3
    ms["step - compute"] = ms["step"] - ms["compute"]
    return ms


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1024, help="requests, all running at once")
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2, help="fresh engines in a row; the median is printed too")
    parser.add_argument("--ignore-eos", action="store_true", help="requests end by length only (no batch changes)")
    parser.add_argument("--overlap", action="store_true", help="the engine's overlap scheduler (Engine(overlap=True))")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    config = ModelConfig.from_dict({**et._COMMON, **et.PRESETS["tiny"][0]})
    model = build_model(config, dtype=torch.float32, device=torch.device("cpu"), seed=0).eval()
    _instrument(model)
    tokenizer = et.word_tokenizer(config.vocab_size)
    runs = []
    for rep in range(args.reps):
        runs.append(run_once(model, tokenizer, args.batch, args.group_size, args.new_tokens, seed=rep, ignore_eos=args.ignore_eos,
                             overlap=args.overlap))
        logger.info("batch %d, run %d, ms per step: %s", args.batch, rep, ", ".join(f"{k} {v:.2f}" for k, v in runs[-1].items()))
    logger.info("batch %d, median ms per step: %s", args.batch,
                ", ".join(f"{k} {statistics.median(r[k] for r in runs):.2f}" for k in runs[0]))


if __name__ == "__main__":
    main()
