"""The orchestrator's host work around one 16 x 16 RL step on CPU: samples assembled from engine answers, rewards,
and the trainer's packed batch, with no model and no engine.

The pieces are the real ones: countdown prompts of `build_tasks` with the countdown-sft tokenizer, `GroupRollout`
(one batched /generate per group, then each answer's token lists and detokenisation, and the countdown verifier
through `compute_reward`), and `train_on_samples`' batch build (`sample_advantages` + `build_train_batch`, GRPO).
Only the client is replaced: it answers every group at once with answers built beforehand as the server's /generate
returns them (log-probs, weight versions, finish reasons; with --replay every row's DSA top-k, base64, as the embedded
engine sends it at indexer_topk_start_len 0). Answers are countdown solutions, right, wrong or unparseable, some with
words before them, 7-64 tokens.

Per step: `assemble` and `reward` are the rollout clock's sums (perf/rollout_assemble_s, perf/rollout_reward_s),
`rollout` the wall time of all the groups' generate_group calls (those two, the replay rows' decoding, the event
loop), `batch` what perf/batch_build_s times. Medians over --steps steps after 2 warm-up steps.

--baseline-tree runs the same measurement with another checkout's code (`git archive <commit>` unpacked) in child
processes alternating with this tree's, and reports per-round ratios and whether both built the same samples and
batch (a digest of rewards, texts and every batch tensor).

    python benchmarks/rollout_host_time.py
    python benchmarks/rollout_host_time.py --replay --baseline-tree /tmp/base --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import logging
import random
import statistics
import time
from pathlib import Path
from typing import Any

import baseline_tree  # beside this script (sys.path[0]): a child on a baseline tree imports this tree's copy

logger = logging.getLogger("rollout_host_time")
PHASES = ("assemble", "reward", "rollout", "batch")
TOKENIZER = Path(__file__).resolve().parent / "assets" / "countdown-sft"
SMALL_TOPK = (2, 256)  # the small preset's (full indexer layers, index_topk): what the H200 recipes run


class AnswerClient:
    """# FAKE: no model; answers each request with the /generate response built for its (prompt, seed) beforehand,
    so that only the orchestrator's host work is timed."""

    def __init__(self) -> None:
        self.answers: dict[tuple[tuple[int, ...], int], dict] = {}

    async def generate_batch(self, prompts, sampling_params, **options) -> list[dict]:
        return [self.answers[tuple(p), sp["sampling_seed"]] for p, sp in zip(prompts, sampling_params)]

    async def generate(self, input_ids, sampling_params=None, **options) -> dict | list[dict]:
        n, seed = sampling_params.get("n", 1), sampling_params["sampling_seed"]
        if n == 1:
            return self.answers[tuple(input_ids), seed]
        return [self.answers[tuple(input_ids), seed + j] for j in range(n)]  # as our server seeds n samples


def answer_text(solution: str, k: int, rng: random.Random) -> str:
    """The k-th sample's answer to a prompt whose right answer is `solution`: right, wrong, unparseable, wordy."""
    kind = k % 4
    if kind == 1:
        solution = solution.replace("+", "-", 1).replace("*", "+", 1)
    elif kind == 2:
        solution = "<answer>" + " ".join(rng.choice(["3", "+", "is", "(", "7", "="]) for _ in range(rng.randint(3, 12)))
    words = "Let me try the numbers one at a time and see which way reaches the target. "
    return words[: rng.randint(0, len(words))] * (1 + k % 3) + solution if kind == 3 else solution


def engine_answer(tokenizer: Any, prompt_ids: list[int], text: str, max_new: int, rng: random.Random,
                  replay: bool) -> dict:
    """A /generate response as rollout/server/protocol.build_response writes it (after JSON)."""
    import numpy as np  # noqa: PLC0415

    ids = tokenizer.encode(text, add_special_tokens=False)
    finish: dict[str, Any] = {"type": "stop", "matched": tokenizer.eos_token_id}
    if len(ids) + 1 > max_new:
        ids, finish = ids[:max_new], {"type": "length", "length": max_new}
    else:
        ids = ids + [tokenizer.eos_token_id]
    meta: dict[str, Any] = {
        "id": f"r{rng.random()}", "finish_reason": finish, "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": 3, "e2e_latency": 0.2,
        "output_token_versions": [3] * len(ids),
        "output_token_logprobs": [[-rng.random() * 2, t, None] for t in ids], "input_token_logprobs": []}
    if replay:
        rows = len(prompt_ids) + len(ids) - 1
        arr = np.random.default_rng(rng.randrange(2**31)).integers(-1, rows, (rows, *SMALL_TOPK)).astype("<i4")
        meta["indexer_topk"] = base64.b64encode(arr.tobytes()).decode("ascii")
        meta["indexer_topk_shape"], meta["indexer_topk_start"] = list(arr.shape), 0
    return {"text": tokenizer.decode(ids), "output_ids": ids, "meta_info": meta}


def digest(samples: list, batch: Any) -> str:
    """sha256 over what the step built: rewards, statuses, texts, per-token lists and every batch tensor."""
    import torch  # noqa: PLC0415

    h = hashlib.sha256()
    for s in samples:
        h.update(repr((s.reward, s.status.value, s.response_text, s.response_ids, s.loss_mask, s.rollout_logprobs,
                       s.weight_versions, s.indexer_topk_start, sorted(s.metadata.items()))).encode())
        if s.indexer_topk is not None:
            h.update(s.indexer_topk.tobytes())
    for name in ("input_ids", "loss_mask", "rollout_logprobs", "advantages", "replay_topk", "rollout_topk"):
        t = getattr(batch, name)
        if t is not None:
            h.update(f"{name}{t.dtype}{tuple(t.shape)}{t.stride()}".encode())
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    h.update(repr((batch.seqlens, batch.prompt_lens)).encode())
    return h.hexdigest()


def measure(args: argparse.Namespace) -> dict:
    """Median seconds of each phase over args.steps steps, and the digest of the last step's samples and batch."""
    import torch  # noqa: PLC0415
    from transformers import AutoTokenizer  # noqa: PLC0415

    from rollout.groups import GroupRollout, SampleNumbering  # noqa: PLC0415
    from slime_dsa.algorithms.specs import build_algorithm  # noqa: PLC0415
    from slime_dsa.config.schema import AlgorithmSection, DataSection, RolloutSection  # noqa: PLC0415
    from slime_dsa.data.prompts import TaskMixture, build_tasks  # noqa: PLC0415
    from slime_dsa.orchestrator.batching import build_train_batch, sample_advantages  # noqa: PLC0415

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    data = DataSection(apply_chat_template=True, tasks=[{"kind": "countdown", "eval_size": 8}])
    tasks = build_tasks(data, tokenizer, train_size=4 * args.prompts)
    prompts = TaskMixture(tasks, seed=0).take(args.prompts)
    rollout = RolloutSection(n_samples_per_prompt=args.group_size, prompts_per_step=args.prompts,
                             max_response_length=args.max_new_tokens, return_indexer_topk=args.replay)
    client = AnswerClient()
    groups = GroupRollout(client, tasks, tokenizer, rollout, seed=0)
    algorithm = build_algorithm(AlgorithmSection(name="grpo", index_replay=args.replay))
    rng = random.Random(0)
    numbering = SampleNumbering()
    for p in prompts:
        for k, s in enumerate(numbering.new_group(p, args.group_size)):
            text = answer_text(p.metadata["solution"], k, rng)
            client.answers[tuple(s.prompt_ids), groups.sample_seed(s)] = engine_answer(
                tokenizer, s.prompt_ids, text, args.max_new_tokens, rng, args.replay)

    async def rollout_step() -> tuple[list, float]:
        numbering.next_sample_index = numbering.next_group_id = 0  # the same samples (and seeds) every step
        fresh = [numbering.new_group(p, args.group_size) for p in prompts]
        groups.reset_reward_stats()
        groups.clock.start()
        start = time.perf_counter()
        done = await asyncio.gather(*(groups.generate_group(g) for g in fresh))
        return [s for g in done for s in g], time.perf_counter() - start

    times: dict[str, list[float]] = {p: [] for p in PHASES}
    loop = asyncio.new_event_loop()
    for step in range(args.steps + 2):
        samples, rollout_s = loop.run_until_complete(rollout_step())
        start = time.perf_counter()
        batch = build_train_batch(samples, sample_advantages(samples, algorithm), index_replay=args.replay)
        batch_s = time.perf_counter() - start
        if step >= 2:
            for name, value in zip(PHASES, (groups.clock.assemble_s, groups.clock.reward_s, rollout_s, batch_s)):
                times[name].append(value)
        del batch
    loop.close()
    return {"ms": {p: statistics.median(v) * 1e3 for p, v in times.items()},
            "digest": digest(samples, build_train_batch(samples, sample_advantages(samples, algorithm),
                                                        index_replay=args.replay)),
            "samples": len(samples), "prompt_tokens_mean": statistics.mean(len(s.prompt_ids) for s in samples),
            "response_tokens_mean": statistics.mean(s.response_length for s in samples),
            "reward_mean": statistics.mean(s.reward for s in samples)}


def compare(args: argparse.Namespace) -> dict:
    """Alternate baseline and this tree in child processes; per-round ratios this/baseline per phase."""
    rounds = []
    for r, pair in enumerate(baseline_tree.alternate(__file__, args.forward, args.baseline_tree, args.rounds)):
        pair["ratio"] = {p: pair["this"]["ms"][p] / pair["baseline"]["ms"][p] for p in PHASES}
        pair["same_results"] = pair["this"]["digest"] == pair["baseline"]["digest"]
        logger.info("round %d: %s; same samples and batch: %s", r + 1, ", ".join(
            f"{p} {pair['baseline']['ms'][p]:.2f} -> {pair['this']['ms'][p]:.2f} ms" for p in PHASES),
            pair["same_results"])
        rounds.append(pair)
    return {"rounds": rounds, "same_results": all(p["same_results"] for p in rounds),
            "baseline_ms": {p: statistics.median(r["baseline"]["ms"][p] for r in rounds) for p in PHASES},
            "this_ms": {p: statistics.median(r["this"]["ms"][p] for r in rounds) for p in PHASES},
            "ratio_median": {p: statistics.median(r["ratio"][p] for r in rounds) for p in PHASES}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--replay", action="store_true", help="engines return every row's DSA top-k (index replay)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per process (after 2 warm-up steps)")
    args = baseline_tree.parse(parser, argv)
    if baseline_tree.answered_as_child(args, measure):
        return
    result = {"this": measure(args)} if args.baseline_tree is None else compare(args)
    result["args"] = {k: v for k, v in vars(args).items() if k != "forward"}
    if "rounds" in result:
        logger.info("median ms, baseline -> this (median of per-round ratios): %s; same samples and batch in every "
                    "round: %s", ", ".join(f"{p} {result['baseline_ms'][p]:.2f} -> {result['this_ms'][p]:.2f} "
                                           f"({result['ratio_median'][p]:.2f}x)" for p in PHASES),
                    result["same_results"])
    else:
        logger.info("%s", json.dumps(result["this"]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
