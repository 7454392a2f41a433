"""Asynchronous REINFORCE with direct double-sided IS (issue 5) on CPU: partial rollouts at the engine, the
staleness gate, and the asynchronous loop end to end against the synchronous one.

Real parts: the embedded engine behind real HTTP on 127.0.0.1, weights pushed through the client exactly as the
loop pushes them, a local Ray cluster, FSDP2 over gloo. The DIS loss and its gradient are tested in
test_algorithms.py (test_dis_*); here it runs inside the loop.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import pytest
import torch
import yaml

import slime_dsa
from slime_dsa.data.sample import Sample
from slime_dsa.models import PackedBatch
from slime_dsa.orchestrator.async_loop import sample_staleness, versions_consistent
from slime_dsa.orchestrator.buffer import StalenessGate
from tests.hf_reference import make_hf_checkpoint

# ---------------------------------------------------------------------------------------------- units


def test_staleness_is_measured_from_the_oldest_generated_token():
    s = Sample(prompt_ids=[1, 2])
    s.append_tokens([3, 4], [-0.1, -0.2], [2, 2])
    s.append_tokens([5], trainable=False)  # a tool token: no version, not counted
    s.append_tokens([6, 7], [-0.3, -0.4], [3, 4])
    assert sample_staleness(s, 4) == 2 and sample_staleness(s, 2) == 0
    assert versions_consistent(s, 4) and not versions_consistent(s, 3)  # a token newer than the trainer
    s.weight_versions[0] = 3  # versions going backwards along the response
    assert not versions_consistent(s, 4)


def test_staleness_gate_bounds_how_far_rollout_runs_ahead():
    async def main():
        gate = StalenessGate(groups_per_step=2, max_staleness=1)
        for _ in range(4):  # (0 + 1 + 1) * 2 groups start under version 0
            await asyncio.wait_for(gate.acquire(), 1)
        blocked = asyncio.ensure_future(gate.acquire())
        await asyncio.sleep(0.01)
        assert not blocked.done()
        await gate.replace(1)  # a discarded group is regenerated
        await asyncio.wait_for(blocked, 1)
        blocked = asyncio.ensure_future(gate.acquire())
        await asyncio.sleep(0.01)
        assert not blocked.done()
        await gate.advance(1)
        await asyncio.wait_for(blocked, 1)
        assert gate.started == 6 and gate.limit == 7

        sync = StalenessGate(groups_per_step=3, max_staleness=0, version=2)  # resumed at step 2: groups 6..8
        for _ in range(3):
            await asyncio.wait_for(sync.acquire(), 1)
        assert sync.started == sync.limit == 9

    asyncio.run(main())


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("async-ckpt")
    make_hf_checkpoint(directory)
    return directory


def _logprobs(model, tokens: list[int]) -> torch.Tensor:
    """Trainer-side log p(x_t | x_<t) of every token of one sequence (temperature 1)."""
    with torch.no_grad():
        logp, _ = model.token_logprobs(torch.tensor(tokens), PackedBatch.from_seqlens([len(tokens)]))
    return logp


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_partial_rollout_keeps_each_tokens_version_and_logprob(checkpoint, mode):
    """Weights pushed over HTTP in the middle of a long generation: the versions flip at one token; with
    retract every token's log-prob equals a trainer forward under its own version's weights."""
    from rollout.client import EngineClient
    from rollout.server.launch import EmbeddedServer, load_engine
    from slime_dsa.orchestrator.weight_sync.http import push_tensors

    old = slime_dsa.load_model(checkpoint).eval()
    g = torch.Generator().manual_seed(1)
    new_state = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in old.state_dict().items()}
    new = slime_dsa.load_model(checkpoint).eval()
    new.load_state_dict(new_state)
    prompt = list(range(3, 19))
    n_new = 150

    async def main():
        engine, tokenizer = load_engine(checkpoint, max_cache_tokens=1024)
        server = await EmbeddedServer.start(engine, tokenizer)
        client = EngineClient([server.url])
        try:
            params = {"max_new_tokens": n_new, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}
            request = asyncio.ensure_future(client.generate(prompt, params))
            while engine.engine.stats["generated_tokens"] < 10:
                await asyncio.sleep(0.002)
            await push_tensors(client, new_state, version=1, pause_mode=mode)
            return await request
        finally:
            await client.close()
            await server.stop()

    out = asyncio.run(main())
    meta = out["meta_info"]
    versions = meta["output_token_versions"]
    ids = [int(t) for _, t, *_ in meta["output_token_logprobs"]]
    rollout_logp = torch.tensor([float(lp) for lp, *_ in meta["output_token_logprobs"]])
    flip = versions.index(1)
    assert len(ids) == n_new and 10 <= flip < n_new, "the update did not land mid-generation"
    assert versions == [0] * flip + [1] * (n_new - flip)
    logp_old = _logprobs(old, prompt + ids)[len(prompt):]
    logp_new = _logprobs(new, prompt + ids)[len(prompt):]
    torch.testing.assert_close(rollout_logp[:flip], logp_old[:flip], atol=1e-4, rtol=0)
    assert (rollout_logp[flip:] - logp_old[flip:]).abs().max() > 1e-2  # the new weights really differ
    if mode == "retract":  # its cache was recomputed under the new weights: exactly π_new
        torch.testing.assert_close(rollout_logp[flip:], logp_new[flip:], atol=1e-4, rtol=0)
    # in_place keeps the cache rows computed under the old weights, so its later tokens were sampled from neither
    # π_old nor π_new of a fresh forward: their recorded log-probs are what the engine sampled from, which is
    # what DIS needs as π_roll; there is no trainer forward to compare them with.


def test_abort_mode_regenerates_samples_in_flight(checkpoint):
    """partial_rollout off: a weight push aborts the requests in flight and the producer regenerates them from
    scratch, so every token of a requeued sample comes from the new weights."""
    from types import SimpleNamespace

    from rollout.client import EngineClient
    from rollout.server.launch import EmbeddedServer, load_engine
    from slime_dsa.config.schema import RolloutSection
    from rollout.groups import GroupRollout, SampleNumbering
    from slime_dsa.data.prompts import Prompt, Task, TaskMixture
    from slime_dsa.orchestrator.producer import GroupProducer
    from slime_dsa.orchestrator.weight_sync.http import push_tensors

    g = torch.Generator().manual_seed(1)
    state = slime_dsa.load_model(checkpoint).state_dict()
    new_state = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    prompts = [Prompt(task="t", split="train", index=i, prompt_ids=list(range(3 + i, 19 + i)), prompt_text="",
                      answer=None) for i in range(4)]
    task = Task(name="t", kind="arithmetic", weight=1.0, reward_fn="tests.plugins.rewards:digit_fraction",
                train=prompts, eval=None)
    rollout = RolloutSection(n_samples_per_prompt=3, prompts_per_step=1, max_response_length=150)
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))  # ids as text

    async def main():
        engine, _ = load_engine(checkpoint, max_cache_tokens=2048)
        server = await EmbeddedServer.start(engine)
        client = EngineClient([server.url])
        groups = GroupRollout(client, [task], tokenizer, rollout)
        producer = GroupProducer(groups, TaskMixture([task]), SampleNumbering(), rollout)
        running = asyncio.ensure_future(producer.produce(StalenessGate(1, 0), requeue_aborted=True))
        try:
            while engine.engine.stats["generated_tokens"] < 15:
                await asyncio.sleep(0.002)
            await push_tensors(client, new_state, version=1, pause_mode="abort")
            (group,) = await asyncio.wait_for(producer.buffer.get(1), 60)
            return group, producer
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await client.close()
            await server.stop()

    group, producer = asyncio.run(main())
    assert sorted(s.index for s in group) == [0, 1, 2] and producer.in_flight == {}
    requeued = [s for s in group if s.metadata.get("requeued")]
    assert requeued, "no request was in flight at the push"
    for s in group:
        assert s.status.value in ("completed", "truncated") and len(set(s.weight_versions)) == 1
    assert all(s.weight_versions[0] == 1 for s in requeued)


# ---------------------------------------------------------------------------------------------- engine capacity

CAPACITY = {"data": {"max_prompt_length": 64},
            "rollout": {"n_samples_per_prompt": 4, "prompts_per_step": 8, "max_response_length": 8},
            "algorithm": {"name": "async_reinforce", "max_staleness": 2}}


def _recipe(patch: dict | None = None):
    from slime_dsa.config import RecipeConfig

    recipe = json.loads(json.dumps(CAPACITY))
    for section, values in (patch or {}).items():
        recipe.setdefault(section, {}).update(values)
    return RecipeConfig.model_validate(recipe)


def test_engine_capacity_counts_the_rollouts_the_loop_can_have_in_flight():
    """(max_staleness + 1) steps' groups in the asynchronous loop, one step's in the synchronous one; each request
    takes its prompt + response rows in whole 16-token blocks (64 + 8 - 1 = 71 -> 80)."""
    from slime_dsa.orchestrator.setup import engine_capacity

    assert engine_capacity(_recipe(), use_async=True) == (3 * 8 * 4 * 80, 256)
    assert engine_capacity(_recipe({"algorithm": {"max_staleness": 0}}), use_async=True) == (4096, 256)  # the floor
    assert engine_capacity(_recipe(), use_async=False) == (4096, 256)  # 32 x 80 = 2560 < the 4096 floor
    wide = _recipe({"rollout": {"prompts_per_step": 40}})
    assert engine_capacity(wide, use_async=True) == (3 * 40 * 4 * 80, 480)  # more requests than the default cap
    assert engine_capacity(wide, use_async=False) == (160 * 80, 256)
    sync = {"name": "grpo"}  # the sampling rounds' keys are the synchronous loop's (refused with async_reinforce)
    dynamic = _recipe({"rollout": {"prompts_per_step": 40, "dynamic_sampling": True, "oversample_factor": 1.5},
                       "algorithm": sync})
    assert engine_capacity(dynamic, use_async=False) == (160 * 4 * 80, 640)  # rounds of up to 4x (max_oversample_factor)
    fixed = _recipe({"rollout": {"prompts_per_step": 40, "dynamic_sampling": True, "oversample_factor": 1.5,
                                 "max_oversample_factor": 1.5}, "algorithm": sync})
    assert engine_capacity(fixed, use_async=False) == (60 * 4 * 80, 256)
    two = _recipe({"rollout": {"prompts_per_step": 40, "num_engines": 2}})  # a group stays on one engine
    assert engine_capacity(two, use_async=True) == (60 * 4 * 80, 256)
    capped = _recipe({"rollout": {"prompts_per_step": 40, "max_concurrency": 100}})
    assert engine_capacity(capped, use_async=True) == (100 * 80, 256)
    assert engine_capacity(_recipe({"rollout": {"max_cache_tokens": 5000}}), use_async=True) == (5000, 256)


def test_engine_capacity_rejects_a_cache_too_small_for_one_rollout():
    from slime_dsa.config import RecipeConfig

    with pytest.raises(ValueError, match=r"rollout.max_cache_tokens \(64\) must hold one rollout"):
        RecipeConfig.model_validate({**CAPACITY, "rollout": {**CAPACITY["rollout"], "max_cache_tokens": 64}})
    with pytest.raises(ValueError, match="max_cache_tokens .* embedded engine's KV cache, but engine is 'external'"):
        RecipeConfig.model_validate({"rollout": {"engine": "external", "engine_urls": ["http://x"],
                                                 "max_cache_tokens": 8192}})


def test_async_engine_admits_every_rollout_in_flight_at_once(checkpoint, ray_cluster):
    """The engine the asynchronous loop starts holds all (max_staleness + 1) x prompts_per_step x n requests of
    full length at once; sized for one synchronous step, as before, it queued some of them."""
    import urllib.request

    import ray

    from rollout.engine import Engine, GenerateRequest, SamplingParams
    from slime_dsa.orchestrator.setup import engine_capacity, start_engines

    recipe = _recipe()
    n = 3 * 8 * 4
    prompts = [[3 + (i + j) % 90 for j in range(64)] for i in range(n)]  # distinct: no prefix is shared

    def admitted(use_async: bool) -> tuple[int, int]:
        tokens, requests = engine_capacity(recipe, use_async)
        engine = Engine(slime_dsa.load_model(checkpoint), max_cache_tokens=tokens, max_running_requests=requests)
        for i, ids in enumerate(prompts):
            sampling = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True, sampling_seed=i)
            engine.add_request(GenerateRequest(rid=str(i), input_ids=ids, sampling=sampling))
        engine.step()
        return engine.num_running, engine.num_queued

    assert admitted(use_async=True) == (n, 0)
    running, queued = admitted(use_async=False)
    assert running < n and queued == n - running

    urls, actors = start_engines(recipe, checkpoint, use_async=True)  # what the loop starts: the sizes reach it
    try:
        info = json.loads(urllib.request.urlopen(f"{urls[0]}/server_info", timeout=30).read())
        assert (info["max_cache_tokens"], info["max_running_requests"]) == engine_capacity(recipe, use_async=True)
        _check_pinning(recipe, actors)
    finally:
        for actor in actors:
            ray.get(actor.stop.remote(), timeout=30)
            ray.kill(actor)


def _affinity(_actor) -> list[int]:
    import os

    return sorted(os.sched_getaffinity(0))


def _check_pinning(recipe, actors) -> None:
    """cluster.pin_cpus on a real engine actor: auto pins for the asynchronous loop only, off never."""
    import os

    import ray

    from slime_dsa.orchestrator.setup import pin_actors

    cores = sorted(os.sched_getaffinity(0))
    off = recipe.model_copy(update={"cluster": recipe.cluster.model_copy(update={"pin_cpus": "off"})})
    assert not pin_actors(off, actors, [], use_async=True)
    assert not pin_actors(recipe, actors, [], use_async=False)  # auto, synchronous loop: left free
    assert ray.get(actors[0].__ray_call__.remote(_affinity)) == cores
    assert pin_actors(recipe, actors, [], use_async=True)
    assert ray.get(actors[0].__ray_call__.remote(_affinity)) == cores[:1]


def test_actor_cores_are_disjoint_runs():
    from slime_dsa.orchestrator.setup import actor_cores

    assert actor_cores([0, 1], 2, 1.0) == [[0], [1]]
    assert actor_cores([0, 1, 2, 3, 4], 2, 1.5) == [[0, 1], [2, 3]]  # whole cores: 1.5 -> 2
    assert actor_cores([0, 1], 3, 1.0) is None and actor_cores([0, 1, 2], 2, 2.0) is None


# ---------------------------------------------------------------------------------------------- the loop

RECIPE = {
    "model": {"preset": "tiny"},
    "data": {"tasks": [{"kind": "arithmetic", "eval_size": 4, "reward_fn": "tests.plugins.rewards:digit_fraction"}],
             "apply_chat_template": True, "max_prompt_length": 96},
    "rollout": {"n_samples_per_prompt": 4, "prompts_per_step": 3, "max_response_length": 8},
    "algorithm": {"name": "async_reinforce", "max_staleness": 0},
    "trainer": {"num_steps": 3, "learning_rate": 3.0e-3, "micro_batch_tokens": 256},
    "logging": {"wandb_mode": "disabled", "eval_every": 2, "eval_at_start": False},  # the ledgers count from step 1
}


def _run(tmp_path, name, recipe, **kwargs):
    from slime_dsa.config import load_recipe
    from slime_dsa.orchestrator.train import run_training

    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run_dir = run_training(load_recipe(path, [f"logging.run_dir={tmp_path / name}"]), **kwargs)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ledger = [json.loads(line) for line in (run_dir / "rollout_ledger.jsonl").read_text().splitlines()] \
        if (run_dir / "rollout_ledger.jsonl").exists() else []
    return records, ledger


def _check_ledger(ledger):
    """Every sample the producer started has exactly one fate; none is trained twice."""
    *steps, end = ledger
    assert end["end"]
    fates = [i for s in steps for key in ("trained", "stale", "discarded") for i in s[key]]
    fates += end["buffered"] + end["in_flight"]
    assert sorted(fates) == sorted(end["produced"]) and len(set(end["produced"])) == len(end["produced"])
    return steps, end


def test_max_staleness_0_is_the_synchronous_loop(tmp_path, ray_cluster):
    """Same seed, same recipe: the async loop at max_staleness 0 trains on the same samples as the synchronous
    loop. Rollout metrics are equal exactly; train metrics within the engines' ~1e-7 log-prob noise (decode
    batches composed differently by request timing; often bit-identical). The loops differ only in perf/
    timings, the async/ diagnostics, and how train_rollout_logprob_abs_diff is computed (the sync loop
    recomputes π_old; the async one has none and takes |log π_θ − log π_roll| from the loss: equal before the
    update). The two runs also use both weight transports (http here, shm by auto there): same weights, same
    samples."""
    over_http = json.loads(json.dumps(RECIPE))
    over_http["rollout"]["weight_sync"] = "http"
    sync, _ = _run(tmp_path, "sync", over_http, loop="sync")
    asyn, ledger = _run(tmp_path, "async", RECIPE)
    assert [r["step"] for r in asyn] == [r["step"] for r in sync] == [1, 2, 3]
    for a, s in zip(asyn, sync):
        assert a["async/staleness_mean"] == a["async/version_spread"] == a["async/stale_samples"] == 0
        # the max and bit-equal fraction of |Δlogp| come from π_old, which the async loop here does not compute
        shared = {k for k in s if not k.startswith("perf/")} - {
            "rollout/sampling_rounds", "time", "elapsed_s", "train/train_rollout_logprob_abs_diff_max",
            "train/train_rollout_logprob_exact_frac"}
        assert shared <= set(a)
        for key in sorted(shared):
            if key.startswith("train/"):  # π_roll enters every train metric: within the ~1e-7 log-prob noise
                assert math.isclose(a[key], s[key], rel_tol=1e-5, abs_tol=1e-6), (key, a[key], s[key])
            else:  # same prompts, seeds, tokens and rewards
                assert a[key] == s[key], (key, a[key], s[key])
        assert a["rollout/num_samples"] == 12
    assert "eval/reward_mean" in asyn[1] and "eval/reward_mean" not in asyn[2]
    steps, end = _check_ledger(ledger)
    # the eval after step 2 takes sample indices 24..27 in both loops, in the same place
    assert [sorted(s["trained"]) for s in steps] == [list(range(0, 12)), list(range(12, 24)), list(range(28, 40))]
    assert end["buffered"] == end["in_flight"] == []  # the gate let nothing start beyond the last step


# Async reward functions run in the driver's process, on its plugin loop (sync ones given by import path run in
# worker processes), so these two share state with the test in memory and wait without holding a reward worker.
STALL = threading.Event()


async def stall_group_zero(sample, response: str, answer, **metadata) -> float:
    """digit_fraction, but group 0 waits for weight version 2 first: it finishes stale by construction."""
    deadline = time.monotonic() + 20
    while sample.group_id == 0 and not STALL.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def test_async_loop_partial_rollouts_staleness_and_accounting(tmp_path, ray_cluster):
    """max_staleness 1, one request at a time so a rollout is always in flight when weights are pushed: some
    trained samples span two versions (retract), group 0 arrives 2 versions late and is dropped, counted and
    logged, and every started sample is accounted for exactly once."""
    recipe = json.loads(json.dumps(RECIPE))
    recipe["data"]["tasks"][0]["reward_fn"] = "tests.test_async:stall_group_zero"
    recipe["logging"]["eval_every"] = 0
    recipe["rollout"].update(max_concurrency=1, max_response_length=32)  # long enough that a push lands mid-answer
    recipe["algorithm"].update(max_staleness=1, partial_rollout="retract")
    recipe["trainer"]["num_steps"] = 5  # group 0 is released after step 2: two more steps to take it
    STALL.clear()

    def on_weights(version, state):
        if version >= 2:
            STALL.set()

    records, ledger = _run(tmp_path, "async1", recipe, on_weights=on_weights)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    steps, end = _check_ledger(ledger)
    assert sum(len(s["stale"]) for s in steps) >= 4  # group 0's four samples at least
    assert [r["async/stale_samples"] for r in records] == [len(s["stale"]) for s in steps]
    assert records[-1]["async/stale_samples_total"] == sum(len(s["stale"]) for s in steps)
    for r in records:
        assert r["async/inconsistent_version_samples"] == 0
        assert r["async/staleness_max"] <= 1 and r["async/version_spread"] <= 1
        assert math.isfinite(r["train/loss"]) and 0 <= r["train/dis_frac_below"] <= 1
    assert any(r["async/partial_rollout_frac"] > 0 for r in records), "no rollout continued across a weight push"
    assert any(r["async/staleness_mean"] > 0 for r in records)
    # the hook's read-back of the weights (hook_state every) is said apart, as in the synchronous loop
    assert all(0 < r["perf/weights_readback_s"] < r["perf/sync_time_s"] for r in records)


SEEN: dict[int, str] = {}


async def record_prompt(sample, response: str, answer, **metadata) -> float:
    """digit_fraction, noting which prompt each sample index was generated for."""
    SEEN[sample.index] = sample.prompt_text
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def test_async_resume_regenerates_the_groups_pending_at_save(tmp_path, ray_cluster):
    """max_staleness 1: when step 2's checkpoint is saved, step 3's groups are already started (in flight or
    buffered). The resumed run regenerates them (same indices, same prompts) before drawing new ones: over both
    runs every sample index has exactly one fate, none is trained twice."""
    from slime_dsa.checkpoint.training import read_orchestrator_state

    recipe = json.loads(json.dumps(RECIPE))
    recipe["data"]["tasks"][0]["reward_fn"] = "tests.test_async:record_prompt"
    recipe["logging"]["eval_every"] = 0
    recipe["algorithm"]["max_staleness"] = 1
    recipe["trainer"]["num_steps"] = 2
    SEEN.clear()
    _run(tmp_path, "resume", recipe)
    before = dict(SEEN)
    pending = read_orchestrator_state(tmp_path / "resume" / "checkpoints" / "step_000002")["rollout"]["pending_groups"]
    assert pending, "nothing was pending at the checkpoint: the test shows nothing"
    pending_indices = [g["first_index"] + k for g in pending for k in range(g["num_samples"])]

    recipe["trainer"]["num_steps"] = 4
    SEEN.clear()
    _, ledger = _run(tmp_path, "resume", recipe, resume=True)
    seen = dict(SEEN)
    first, second = ledger[:3], ledger[3:]
    assert [line.get("step") for line in first[:2]] == [1, 2] and first[2]["end"]
    *steps, end = second
    assert [s["step"] for s in steps] == [3, 4] and end["end"]
    assert end["produced"][:len(pending_indices)] == pending_indices  # regenerated first, with their own indices
    fates = [i for s in first[:2] + steps for key in ("trained", "stale", "discarded") for i in s[key]]
    fates += end["buffered"] + end["in_flight"]
    assert sorted(fates) == list(range(max(end["produced"]) + 1)), "a sample was lost or used twice"
    trained = [i for s in first[:2] + steps for i in s["trained"]]
    assert len(trained) == len(set(trained)) == 4 * 3 * 4
    assert set(pending_indices) <= {i for s in steps for key in ("trained", "stale", "discarded") for i in s[key]}
    # Samples scored in both runs (pending groups that had finished before the save; on a loaded machine there may
    # be none, as all pending groups can still be generating then) carry the same prompt.
    same = set(before) & set(seen)
    assert all(before[i] == seen[i] for i in same), "a regenerated sample has another prompt"


def test_async_resume_after_an_interrupted_step_keeps_one_fate_per_sample(tmp_path, ray_cluster):
    """SIGTERM (as a scheduler sends it) while step 3 pushes its weights, after step 2's checkpoint; then --resume.
    Before: rollout_ledger.jsonl kept the interrupted session's step 3 and the resumed one wrote step 3 again, so
    the ledger showed step 3's samples trained twice. Now the resume drops the records past its checkpoint: over both
    sessions each sample index has one fate, none is trained twice, and a regenerated index keeps its prompt."""
    import os
    import signal

    from slime_dsa import interrupts

    recipe = json.loads(json.dumps(RECIPE))
    recipe["data"]["tasks"][0]["reward_fn"] = "tests.test_async:record_prompt"
    recipe["logging"]["eval_every"] = 0
    recipe["algorithm"]["max_staleness"] = 1
    recipe["trainer"]["num_steps"] = 4
    recipe["checkpoint"] = {"save_every": 2}

    def sigterm_in_step_3(version, state):
        if version == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    SEEN.clear()
    previous = signal.signal(signal.SIGTERM, interrupts.terminate)  # what the CLI installs
    try:
        with pytest.raises(KeyboardInterrupt, match="interrupted during step 3"):
            _run(tmp_path, "cut", recipe, on_weights=sigterm_in_step_3)
    finally:
        interrupts.reset()
        signal.signal(signal.SIGTERM, previous)
    before = dict(SEEN)
    assert [p.name for p in sorted((tmp_path / "cut" / "checkpoints").glob("step_*"))] == ["step_000002"]
    cut = [json.loads(line) for line in (tmp_path / "cut" / "rollout_ledger.jsonl").read_text().splitlines()]
    assert [line.get("step") for line in cut if "step" in line] == [1, 2, 3]  # step 3 was taken and trained

    SEEN.clear()
    records, ledger = _run(tmp_path, "cut", recipe, resume=True)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    steps = [line for line in ledger if "step" in line]
    assert [s["step"] for s in steps] == [1, 2, 3, 4], "a step's record is in the ledger twice"
    end = ledger[-1]
    fates = [i for s in steps for key in ("trained", "stale", "discarded") for i in s[key]]
    fates += end["buffered"] + end["in_flight"]
    assert sorted(fates) == list(range(max(end["produced"]) + 1)), "a sample was lost or used twice"
    trained = [i for s in steps for i in s["trained"]]
    assert len(trained) == len(set(trained)) == 4 * 3 * 4
    same = set(before) & set(SEEN)
    assert same and all(before[i] == SEEN[i] for i in same), "a regenerated sample index has another prompt"


def test_async_resume_with_a_lower_max_staleness_keeps_no_older_rollout(tmp_path, ray_cluster):
    """A run at max_staleness 2 resumed with max_staleness 0: the checkpoint holds the groups started and not trained
    as prompts, not tokens, and the resume generates them again under its weights, so the new bound holds from the
    first resumed step (nothing to drop), every sample keeps one fate, and train.log says how many were regenerated."""
    from slime_dsa.checkpoint.training import read_orchestrator_state

    recipe = json.loads(json.dumps(RECIPE))
    recipe["data"]["tasks"][0]["reward_fn"] = "tests.test_async:record_prompt"
    recipe["logging"]["eval_every"] = 0
    recipe["algorithm"]["max_staleness"] = 2
    recipe["trainer"]["num_steps"] = 2
    _run(tmp_path, "lower", recipe)
    state = read_orchestrator_state(tmp_path / "lower" / "checkpoints" / "step_000002")
    pending = state["rollout"]["pending_groups"]
    assert len(pending) > recipe["rollout"]["prompts_per_step"], "no more pending than one step: the test shows nothing"
    pending_indices = [g["first_index"] + k for g in pending for k in range(g["num_samples"])]

    recipe["algorithm"]["max_staleness"] = 0
    recipe["trainer"]["num_steps"] = 5
    records, ledger = _run(tmp_path, "lower", recipe, resume=True)
    resumed = [r for r in records if r["step"] > 2]
    assert [r["step"] for r in resumed] == [3, 4, 5]
    assert all(r["async/staleness_max"] == r["async/stale_samples"] == 0 for r in resumed)
    steps = [line for line in ledger if "step" in line]
    end = ledger[-1]
    assert end["produced"][:len(pending_indices)] == pending_indices  # regenerated first, with their own indices
    fates = [i for s in steps for key in ("trained", "stale", "discarded") for i in s[key]]
    assert sorted(fates + end["buffered"] + end["in_flight"]) == list(range(max(end["produced"]) + 1))
    assert len(set(i for s in steps for i in s["trained"])) == 5 * 3 * 4
    log = (tmp_path / "lower" / "train.log").read_text()
    assert f"{len(pending)} groups started and not trained" in log and "algorithm.max_staleness 0" in log
