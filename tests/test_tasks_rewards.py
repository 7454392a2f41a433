"""The data side of the RL loop: Sample, built-in tasks, prompt datasets, the task mixture, and rewards."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import warnings
from collections import Counter

import datasets
import numpy as np
import pytest

from rollout.rewards import (
    MathVerifyPool,
    MathVerifyTimeout,
    RewardLoadError,
    RewardStats,
    arithmetic_reward,
    compute_reward,
    countdown_reward,
    extract_tagged,
    last_number,
    load_reward_fn,
    math_verify_reward,
    sort_reward,
)
from rollout.rewards.compute import close_reward_pool, reward_step_metrics
from rollout.rewards.countdown import parse_expression
from rollout.rewards.math_verifier import get_math_verify_pool
from slime_dsa.config.errors import UserError
from slime_dsa.data.prompts import PromptDataError, Task, TaskMixture, build_tasks, encode_prompts, load_task
from slime_dsa.data.sample import Sample, SampleStatus
from slime_dsa.data.tasks import build_task_splits

datasets.disable_progress_bars()


@pytest.fixture(scope="module")
def tokenizer():
    from slime_dsa.data.tokenizer import build_tokenizer

    return build_tokenizer()


# ---------------------------------------------------------------------------------------------------- Sample


def test_sample_round_trip_through_json() -> None:
    sample = Sample(prompt_ids=[1, 2, 3], task="arithmetic", index=7, group_id=2, answer={"target": 3},
                    prompt_text="p", metadata={"k": [1, 2]})
    sample.append_tokens([4, 5], logprobs=[-0.1, -0.2], weight_versions=[3, 3])
    sample.append_tokens([6], trainable=False)  # a tool result
    sample.indexer_topk = np.arange(3 * 2 * 4).reshape(3, 2, 4)
    sample.status = SampleStatus.TRUNCATED
    sample.validate()
    assert sample.loss_mask == [1, 1, 0] and sample.weight_versions == [3, 3, -1]
    assert sample.rollout_logprobs == [-0.1, -0.2, 0.0] and sample.tokens == [1, 2, 3, 4, 5, 6]

    back = Sample.from_dict(json.loads(json.dumps(sample.to_dict())))
    assert back.status is SampleStatus.TRUNCATED and back.indexer_topk.dtype == np.int32
    np.testing.assert_array_equal(back.indexer_topk, sample.indexer_topk)
    assert {k: v for k, v in back.to_dict().items()} == sample.to_dict()

    with pytest.raises(ValueError, match="unknown field 'bogus'"):
        Sample.from_dict({"prompt_ids": [1], "bogus": 1})
    sample.loss_mask.append(1)
    with pytest.raises(ValueError, match="loss_mask has 4 entries, response_ids has 3"):
        sample.validate()


# ---------------------------------------------------------------------------------------------------- tasks


@pytest.mark.parametrize("kind", ["arithmetic", "countdown", "sort"])
def test_task_generators_deterministic_with_disjoint_eval(kind: str) -> None:
    a = build_task_splits(kind, train_size=300, eval_size=50, seed=5)
    b = build_task_splits(kind, train_size=300, eval_size=50, seed=5)
    assert a["train"][:] == b["train"][:] and a["eval"][:] == b["eval"][:]
    assert build_task_splits(kind, train_size=300, eval_size=50, seed=6)["train"][:] != a["train"][:]
    # The eval split does not depend on train_size, and never shares a prompt with train.
    assert build_task_splits(kind, train_size=10, eval_size=50, seed=5)["eval"][:] == a["eval"][:]
    train, evals = set(a["train"]["prompt"]), set(a["eval"]["prompt"])
    assert len(a["train"]) == 300 and len(evals) == 50 and not train & evals


def test_train_split_follows_the_eval_distribution() -> None:
    """In a small problem space train must not drift from eval: distinct train prompts would exhaust the
    one-digit problems (200 of 20,000) and leave train mostly two-by-two-digit problems."""
    splits = build_task_splits("arithmetic", train_size=15000, eval_size=256, seed=7, max_digits=2)

    def two_by_two(prompts: list[str]) -> float:
        return sum(all(len(x) == 2 for x in p.split(".")[0].removeprefix("Compute ").split(" ")[::2])
                   for p in prompts) / len(prompts)

    train, evals = splits["train"]["prompt"], splits["eval"]["prompt"]
    assert abs(two_by_two(train) - two_by_two(evals)) < 0.06, (two_by_two(train), two_by_two(evals))
    assert abs(two_by_two(train) - 0.25) < 0.02  # two digits is drawn with probability 1/2 for each operand
    assert not set(train) & set(evals)


@pytest.mark.parametrize("kind,reward", [("arithmetic", arithmetic_reward), ("countdown", countdown_reward),
                                         ("sort", sort_reward)])
def test_reference_solutions_score_one(kind: str, reward) -> None:
    rows = build_task_splits(kind, train_size=200, eval_size=0, seed=1)["train"]
    for row in rows:
        assert reward(None, row["solution"], row["answer"])["reward"] == 1.0, row


def test_task_parameters_checked() -> None:
    with pytest.raises(ValueError, match="unknown task parameter 'digits'"):
        build_task_splits("arithmetic", train_size=1, digits=3)
    with pytest.raises(ValueError, match="min_digits"):
        build_task_splits("arithmetic", train_size=1, min_digits=4, max_digits=2)
    with pytest.raises(ValueError, match="found only .* distinct problems"):
        build_task_splits("arithmetic", train_size=1, eval_size=500, max_digits=1, ops="+")  # only 100 exist
    with pytest.raises(ValueError, match="found only 0 new problems"):
        build_task_splits("arithmetic", train_size=1, eval_size=100, max_digits=1, ops="+")  # eval took them all
    with pytest.raises(ValueError, match="unknown built-in task 'sudoku'"):
        build_task_splits("sudoku")
    hard = build_task_splits("arithmetic", train_size=50, min_digits=5, max_digits=5, num_operands=3,
                             allow_negative=False)["train"]
    assert all(int(a) >= 0 for a in hard["answer"]) and all(p.count(" ") >= 5 for p in hard["prompt"])


# ---------------------------------------------------------------------------------------------------- verifiers


def test_answer_extraction() -> None:
    assert extract_tagged("think... <answer>1</answer> no, <answer> 2 </answer>") == "2"
    assert extract_tagged("<answer>1</answer> hmm <answer>3") == "3"  # open tag at the end (length cut)
    assert extract_tagged("no tags 5") is None
    assert last_number("the sum is 1,234.") == 1234 and last_number("x = −7") == -7
    assert last_number("5-3") == 3 and last_number("2.50") == 2.5 and last_number("none") is None


@pytest.mark.parametrize("response,reward", [
    ("<answer>432</answer>", 1.0),
    ("47 + 385 = 432", 1.0),  # untagged: the last number
    ("The answer is <answer>431</answer>", 0.0),
    ("<answer>432.0</answer>", 1.0),
    ("I don't know", 0.0),
    ("", 0.0),
])
def test_arithmetic_reward(response: str, reward: float) -> None:
    assert arithmetic_reward(None, response, "432")["reward"] == reward
    assert arithmetic_reward(None, "<answer>-12</answer>", -12)["reward"] == 1.0
    with pytest.raises(ValueError, match="not an integer"):
        arithmetic_reward(None, "1", "one")


COUNTDOWN = {"target": 24, "numbers": [4, 6, 8, 2], "use_all": False}


@pytest.mark.parametrize("response,reward", [
    ("<answer>(8 - 4) * 6</answer>", 1.0),  # at most once: 2 unused is fine
    ("<answer>4 * 6</answer>", 1.0),
    ("<answer>8 × (6 / 2)</answer>", 1.0),
    ("I think it is\n(8 - 2) * 4 = 24", 1.0),  # untagged: last line, "= target" ignored
    ("<answer>6 * 4 * 1</answer>", 0.0),  # 1 is not given
    ("<answer>6 * 6 - 8 - 4</answer>", 0.0),  # 6 used twice
    ("<answer>4 + 6 + 8</answer>", 0.0),  # 18
    ("<answer>2 ** 4 + 8</answer>", 0.0),  # ** is not allowed
    ("<answer>__import__('os')</answer>", 0.0),
    ("<answer>8 / (4 - 4)</answer>", 0.0),
    ("<answer>(((</answer>", 0.0),
    ("<answer>2 * 17e</answer>", 0.0),  # no SyntaxWarning from ast.parse either (test below)
])
def test_countdown_reward(response: str, reward: float) -> None:
    assert countdown_reward(None, response, COUNTDOWN)["reward"] == reward


@pytest.mark.parametrize("response,reward", [
    ("<answer>3, 7, 19, 42</answer>", 1.0),
    ("First 3 then 7.\n<answer>3 7 19 42</answer>", 1.0),  # separators do not matter, the numbers and order do
    ("3, 7, 19, 42", 1.0),  # untagged: the last line
    ("<answer>3, 19, 7, 42</answer>", 0.0),
    ("<answer>3, 7, 19</answer>", 0.0),
    ("<answer>3, 7, 19, 42, 42</answer>", 0.0),
])
def test_sort_reward(response: str, reward: float) -> None:
    assert sort_reward(None, response, [3, 7, 19, 42])["reward"] == reward
    assert sort_reward(None, response, "[3, 7, 19, 42]")["reward"] == reward  # a JSON string from a dataset file


def test_countdown_model_text_parses_without_warnings() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [parse_expression(text) for text in ("3and 4", "0x1for", "1if 2")] == [None] * 3
    assert not caught, [str(w.message) for w in caught]


def test_countdown_use_all_and_json_answer() -> None:
    strict = json.dumps({**COUNTDOWN, "use_all": True})
    assert countdown_reward(None, "<answer>4 * 6</answer>", strict)["reward"] == 0.0
    assert countdown_reward(None, "<answer>(8 - 6 + 2) * 4 + 8</answer>", strict)["reward"] == 0.0  # 8 twice
    assert countdown_reward(None, "<answer>(8 - 6 + 2) * 6</answer>", strict)["reward"] == 0.0  # 4 missing
    assert countdown_reward(None, "<answer>(6 + 2) * 4 - 8</answer>", strict)["reward"] == 1.0
    with pytest.raises(ValueError, match="'target' and 'numbers'"):
        countdown_reward(None, "1", {"numbers": [1]})


@pytest.mark.parametrize("response,answer,reward", [
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("<answer>$\\frac12$</answer>", "\\frac{1}{2}", 1.0),
    ("<answer>\\sqrt{2}</answer>", "\\sqrt 2", 1.0),
    ("so x = 3", "3", 1.0),
    ("<answer>33</answer>", "3", 0.0),
    ("\\boxed{(1, 2)}", "$(1,2)$", 1.0),
    ("<answer>2\\pi</answer>", "$2\\pi$", 1.0),
    ("no idea", "7", 0.0),
])
def test_math_verify_reward(response: str, answer: str, reward: float) -> None:
    assert math_verify_reward(None, response, answer)["reward"] == reward


def test_math_verify_runs_off_the_main_thread_and_survives_a_hang() -> None:
    results = []
    thread = threading.Thread(target=lambda: results.append(math_verify_reward(None, "\\boxed{4}", "4")))
    thread.start()
    thread.join()
    assert results[0]["reward"] == 1.0  # math-verify's signal timeout would raise in a thread; the pool does not

    pool = MathVerifyPool(max_workers=1, timeout_s=1.0, inner_timeout_s=30)  # inner limit too late: the hard one acts
    try:
        start = time.perf_counter()
        with pytest.raises(MathVerifyTimeout):
            pool.verify("$10^{10^{10}}$", "5")  # sympy hangs on this
        assert time.perf_counter() - start < 5 and pool.num_killed == 1
        assert pool.verify("4", "4")["correct"]  # a fresh worker replaces the killed one
    finally:
        pool.close()


# ---------------------------------------------------------------------------------------------------- rewards


CUSTOM_REWARDS = '''
import asyncio
import os
import time

def exact(sample, response, answer, **metadata):
    return {"reward": float(response.strip() == answer), "length": len(response), "note": "ignored"}

def scaled(sample, response, answer, scale=1.0):
    return scale * float(response.strip() == answer)

async def slow_match(sample, response, answer, **metadata):
    await asyncio.sleep(metadata.get("delay", 0.0))
    return float(response.strip() == answer)

def boom(sample, response, answer, **metadata):
    raise RuntimeError("verifier crashed")

def own_timeout(sample, response, answer):
    raise TimeoutError("upstream judge timed out")

def not_a_number(sample, response, answer):
    return "yes"

def two_args(sample, response):
    return 1.0

class Graders:
    @staticmethod
    def prompt_len(sample, response, answer):
        return float(len(sample.prompt_text))

def hang(sample, response, answer, **metadata):
    with open(metadata["pid_dir"] + f"/{os.getpid()}", "w"):
        pass
    time.sleep(metadata.get("hang_s", 20.0))
    return 1.0

def whoami(sample, response, answer):
    return float(os.getpid())

def exits(sample, response, answer):
    raise SystemExit(3)

def interrupted(sample, response, answer):
    raise KeyboardInterrupt

async def exits_async(sample, response, answer):
    raise SystemExit(4)

async def blocks(sample, response, answer, **metadata):
    time.sleep(metadata["block_s"])  # blocks its event loop: what an async reward must not do
    return 1.0

NOT_CALLABLE = 3
'''


@pytest.fixture
def custom_rewards(tmp_path, monkeypatch) -> str:
    (tmp_path / "my_rewards_mod.py").write_text(CUSTOM_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards_mod"
    close_reward_pool()  # its workers imported this test's module; the next test starts afresh


def _sample(response: str, answer: str = "42", **metadata) -> Sample:
    return Sample(prompt_ids=[1], prompt_text="What?", response_text=response, answer=answer, task="t",
                  metadata=metadata)


def test_custom_rewards_by_import_path(custom_rewards: str) -> None:
    stats = RewardStats()

    async def main():
        exact = await compute_reward(f"{custom_rewards}:exact", _sample("42", extra="x"), stats=stats)
        assert exact.reward == 1.0 and not exact.failed and exact.metrics == {"length": 2.0}
        # Without **kwargs a function receives only the metadata it names.
        scaled = await compute_reward(f"{custom_rewards}:scaled", _sample("42", scale=0.5, other=1), stats=stats)
        assert scaled.reward == 0.5 and not scaled.failed
        fn = load_reward_fn(f"{custom_rewards}:slow_match")
        assert fn.is_async
        results = await asyncio.gather(*(compute_reward(fn, _sample(r, delay=0.05), stats=stats)
                                         for r in ("42", "41", "42")))
        assert [r.reward for r in results] == [1.0, 0.0, 1.0]
        method = await compute_reward(f"{custom_rewards}:Graders.prompt_len", _sample("x"), stats=stats)
        assert method.reward == 5.0

    asyncio.run(main())
    assert stats.calls == 6 and stats.failures == 0


def test_failing_rewards_cost_one_sample(custom_rewards: str, caplog) -> None:
    stats = RewardStats()

    async def main():
        return await asyncio.gather(
            compute_reward(f"{custom_rewards}:boom", _sample("42"), stats=stats),
            compute_reward(f"{custom_rewards}:not_a_number", _sample("42"), stats=stats),
            compute_reward(f"{custom_rewards}:slow_match", _sample("42", delay=5.0), timeout_s=0.1, stats=stats),
            compute_reward(f"{custom_rewards}:exact", _sample("42"), stats=stats),
            compute_reward("countdown", _sample("<answer>1</answer>", answer="not json"), stats=stats),
            compute_reward(f"{custom_rewards}:own_timeout", _sample("42"), stats=stats),
        )

    with caplog.at_level("WARNING", logger="rollout.rewards.compute"):
        boom, wrong_type, slow, fine, bad_truth, own_timeout = asyncio.run(main())
    assert boom.reward == 0.0 and boom.failed and boom.error == "RuntimeError: verifier crashed"
    assert wrong_type.failed and "returned str" in wrong_type.error
    assert slow.failed and slow.error == "timed out after 0.1s"
    assert bad_truth.failed and bad_truth.reward == 0.0
    assert fine.reward == 1.0 and not fine.failed
    assert own_timeout.failed and own_timeout.error == "TimeoutError: upstream judge timed out"
    assert (stats.calls, stats.failures, stats.timeouts) == (6, 5, 1)
    assert "verifier crashed" in caplog.text


def test_a_reward_that_exits_or_interrupts_costs_one_sample(custom_rewards: str) -> None:
    """SystemExit and KeyboardInterrupt are no Exception: raised by a reward function (in a worker process, a thread,
    inline or as a coroutine) they used to end the driver's event loop, and the run with it."""
    from rollout.rewards.registry import RewardFunction

    def exits_in_thread(sample, response, answer):
        raise SystemExit(5)

    stats = RewardStats()
    fns = [f"{custom_rewards}:exits", f"{custom_rewards}:interrupted", f"{custom_rewards}:exits_async",
           RewardFunction.wrap(exits_in_thread, isolation="thread"),
           RewardFunction.wrap(exits_in_thread, isolation="inline")]

    async def main():
        failed = await asyncio.gather(*(compute_reward(fn, _sample("42"), timeout_s=20, stats=stats) for fn in fns))
        return failed, await compute_reward(f"{custom_rewards}:exact", _sample("42"), stats=stats)

    failed, fine = asyncio.run(main())
    assert [r.error for r in failed] == [
        "RuntimeError: raised SystemExit(3)", "RuntimeError: raised KeyboardInterrupt()",
        "RuntimeError: raised SystemExit(4)", "RuntimeError: raised SystemExit(5)", "SystemExit: 5"]
    assert all(r.failed and r.reward == 0.0 for r in failed) and fine.reward == 1.0
    assert (stats.calls, stats.failures) == (6, 5)


def test_an_async_reward_that_blocks_its_event_loop_costs_one_sample(custom_rewards: str, caplog) -> None:
    """An async reward that blocks (time.sleep past its deadline) used to block the rollout's event loop, deadline
    and all, so a longer block hung the run: it runs on the plugin loop now and costs its own sample (0, a timeout,
    logged); the rewards submitted while that loop is stuck start on a fresh one, and later ones are scored as usual."""
    from rollout import plugin_loop

    stats = RewardStats()
    block_s = 4.0
    abandoned = plugin_loop.abandoned_threads()

    async def main():
        ticks = 0

        async def tick():  # the rollout's loop keeps running while the reward blocks
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        ticker = asyncio.create_task(tick())
        start = time.perf_counter()
        blocked = asyncio.create_task(compute_reward(f"{custom_rewards}:blocks", _sample("42", block_s=block_s),
                                                     timeout_s=0.3, stats=stats))
        await asyncio.sleep(0.1)
        beside = await asyncio.gather(*(compute_reward(f"{custom_rewards}:slow_match", _sample(r), timeout_s=5,
                                                       stats=stats) for r in ("42", "41", "42")))
        blocked = await blocked
        after = await compute_reward(f"{custom_rewards}:slow_match", _sample("42"), timeout_s=5, stats=stats)
        ticker.cancel()
        return blocked, beside, after, time.perf_counter() - start, ticks

    with caplog.at_level("WARNING"):
        blocked, beside, after, wall_s, ticks = asyncio.run(main())
    assert blocked.failed and blocked.timed_out and blocked.reward == 0.0 and blocked.error == "timed out after 0.3s"
    assert [r.reward for r in beside] == [1.0, 0.0, 1.0] and after.reward == 1.0 and not after.failed
    assert wall_s < block_s - 1 and ticks >= 10
    assert (stats.calls, stats.failures, stats.timeouts) == (5, 1, 1)
    assert plugin_loop.abandoned_threads() == abandoned + 1
    assert f"reward function {custom_rewards}:blocks failed on sample" in caplog.text
    assert f"plugin loop stuck: reward function {custom_rewards}:blocks passed its 0.3s deadline" in caplog.text
    assert load_reward_fn(f"{custom_rewards}:blocks").isolation == "loop"


def test_hung_rewards_are_killed_and_replaced(custom_rewards: str, tmp_path) -> None:
    stats = RewardStats()
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()

    async def main():
        hung = await asyncio.gather(*(compute_reward(f"{custom_rewards}:hang", _sample("42", pid_dir=str(pid_dir)),
                                                     timeout_s=0.5, stats=stats) for _ in range(8)))
        start = time.perf_counter()
        fine = await asyncio.gather(*(compute_reward(f"{custom_rewards}:exact", _sample("42"), timeout_s=5, stats=stats)
                                      for _ in range(8)))
        return hung, fine, time.perf_counter() - start

    hung, fine, fine_s = asyncio.run(main())
    assert all(r.failed and r.timed_out and r.reward == 0.0 and r.error == "timed out after 0.5s" for r in hung)
    assert all(r.reward == 1.0 and not r.failed for r in fine) and fine_s < 3  # the pool still has workers
    assert (stats.calls, stats.failures, stats.timeouts) == (16, 8, 8)
    pids = [int(p.name) for p in pid_dir.iterdir()]
    assert pids and os.getpid() not in pids
    for pid in pids:  # every worker that ran a hung call was killed
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_sync_custom_rewards_run_in_worker_processes_builtins_inline(custom_rewards: str) -> None:
    async def main():
        return await compute_reward(f"{custom_rewards}:whoami", _sample("42"))

    assert asyncio.run(main()).reward not in (0.0, float(os.getpid()))
    assert load_reward_fn(f"{custom_rewards}:whoami").isolation == "process"
    assert load_reward_fn("arithmetic").isolation == load_reward_fn("countdown").isolation == "inline"


def test_a_forked_child_starts_its_own_reward_workers(custom_rewards: str) -> None:
    """The reward pool a parent started is dead in a child it forks (pebble's threads do not survive a fork): every
    reward there failed with 'Unexpected error within the Pool' instead of starting the child's own workers."""
    def score() -> float:
        return asyncio.run(compute_reward(f"{custom_rewards}:exact", _sample("42"), timeout_s=10)).reward

    assert score() == 1.0  # the parent's workers are up
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one reward, its result down the pipe, and out
        try:
            os.write(write, repr(score()).encode())
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 30
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            pytest.fail("the forked child's reward call hung")
        time.sleep(0.05)
    with os.fdopen(read) as f:
        assert f.read() == "1.0"


def test_a_step_with_many_reward_timeouts_warns(caplog) -> None:
    stats = {"math": RewardStats(calls=40, failures=3, timeouts=2), "arithmetic": RewardStats(calls=40)}
    with caplog.at_level("WARNING", logger="rollout.rewards.compute"):
        metrics = reward_step_metrics(stats, timeout_warn_share=0.02)
    assert metrics == {"rollout/reward_failures": 3, "rollout/reward_timeouts": 2}
    assert len(caplog.records) == 1
    assert "2 of 80 reward calls (2.5%) timed out" in caplog.text and "math: 2 of 40" in caplog.text
    assert "rollout.reward_timeout_warn_share (2.0%)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="rollout.rewards.compute"):
        reward_step_metrics(stats, timeout_warn_share=0.025)  # 2.5% is not more than 2.5%
    assert not caplog.records


@pytest.mark.parametrize("spec,message", [
    ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz' (ModuleNotFoundError"),
    ("{mod}:missing", "has no attribute 'missing'"),
    ("{mod}:NOT_CALLABLE", "is not callable"),
    ("{mod}:two_args", "takes 2 positional parameter"),
    ("{mod}:", "must look like 'package.module:function'"),
    ("nonexistent_name", "unknown reward function 'nonexistent_name'; registered: arithmetic, countdown"),
])
def test_reward_load_errors_name_the_path(custom_rewards: str, spec: str, message: str) -> None:
    spec = spec.format(mod=custom_rewards)
    with pytest.raises(RewardLoadError) as info:
        load_reward_fn(spec)
    assert message in str(info.value) and repr(spec) in str(info.value)


def test_builtin_rewards_through_compute_reward() -> None:
    async def main():
        return await asyncio.gather(
            compute_reward("arithmetic", _sample("<answer>42</answer>")),
            compute_reward("math_verify", _sample("\\boxed{\\frac{84}{2}}")),
            compute_reward("math_verify", _sample("\\boxed{41}")),
        )

    arith, math_ok, math_wrong = asyncio.run(main())
    assert (arith.reward, math_ok.reward, math_wrong.reward) == (1.0, 1.0, 0.0)
    assert math_ok.metrics["answer_found"] == 1.0 and not math_wrong.failed


# ---------------------------------------------------------------------------------------------------- datasets


ROWS = [
    {"question": "What is 2 + 2?", "solution": "4", "source": "a"},
    {"question": "What is 3 * 3?", "solution": "9", "source": "b"},
    {"question": "Name the 3rd prime.", "solution": "5", "source": "c"},
    {"question": "What is 10 / 2?", "solution": "5", "source": "d"},
]


def _write(kind: str, tmp_path, rows=ROWS):
    if kind == "jsonl":
        path = tmp_path / "prompts.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "parquet":
        path = tmp_path / "prompts.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        path = tmp_path / "prompts_dir"
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "disk"])
def test_load_dataset_with_column_mapping_and_chat_template(kind: str, tmp_path, tokenizer) -> None:
    path = _write(kind, tmp_path)
    task = load_task("qa", tokenizer, path=str(path), prompt_column="question", answer_column="solution",
                     system_prompt="Be brief.", apply_chat_template=True, eval_size=1, seed=3,
                     cache_dir=str(tmp_path / "cache"))
    assert len(task.train) == 3 and len(task.eval) == 1 and task.reward_fn == "math_verify"
    prompts = list(task.train) + list(task.eval)
    assert sorted(p.index for p in prompts) == [0, 1, 2, 3]
    for p in prompts:
        row = ROWS[p.index]
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": row["question"]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert p.prompt_text == text and p.prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert p.answer == row["solution"] and p.metadata == {"source": row["source"]}
    assert task.eval[0].prompt_text not in {p.prompt_text for p in task.train}


def test_chat_message_prompts_and_raw_text(tmp_path, tokenizer) -> None:
    rows = [{"prompt": [{"role": "system", "content": "Sys"}, {"role": "user", "content": "Hi"}], "answer": "1"}]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n")
    task = load_task("chat", tokenizer, path=str(path), system_prompt="ignored: the row has one",
                     cache_dir=str(tmp_path / "cache"))
    assert task.train[0].prompt_text == "[gMASK]<sop><|system|>\nSys<|user|>\nHi<|assistant|>\n"

    raw = load_task("raw", tokenizer, kind="arithmetic", train_size=5, system_prompt="Solve it.")
    assert raw.train[0].prompt_text.startswith("Solve it.\n\nCompute ") and raw.reward_fn == "arithmetic"
    assert raw.train[0].prompt_ids == tokenizer(raw.train[0].prompt_text, add_special_tokens=False)["input_ids"]


def test_long_prompts_dropped_and_counted(tmp_path, tokenizer, caplog) -> None:
    rows = [{"prompt": "short", "answer": "1"}, {"prompt": "long " * 50, "answer": "2"},
            {"prompt": "also short", "answer": "3"}]
    path = _write("jsonl", tmp_path, rows)
    with caplog.at_level("WARNING", logger="slime_dsa.data.prompts"):
        task = load_task("t", tokenizer, path=str(path), max_prompt_length=20, cache_dir=str(tmp_path / "cache"))
    assert [p.answer for p in task.train] == ["1", "3"] and task.num_dropped_too_long == {"train": 1, "eval": 0}
    assert "dropped 1 of 3 prompts longer than max_prompt_length=20" in caplog.text


@pytest.mark.parametrize("rows,message", [
    ([{"prompt": "ok", "answer": "1"}, {"prompt": "ok", "answer": "2"}, {"prompt": 7, "answer": "3"}],
     "row 2, column 'prompt': expected a string or a list of chat messages, got int"),
    ([{"prompt": "ok", "answer": "1"}, {"prompt": "fine"}], "row 1, column 'answer': missing value"),
    ([{"prompt": [{"content": "no role"}], "answer": "1"}], "row 0, column 'prompt': expected chat messages"),
    ([{"question": "ok", "answer": "1"}], "no column 'prompt' (columns: question, answer); set prompt_column"),
])
def test_bad_rows_name_file_row_and_column(tmp_path, tokenizer, rows, message) -> None:
    path = _write("jsonl", tmp_path, rows)
    with pytest.raises(PromptDataError) as info:
        load_task("t", tokenizer, path=str(path), cache_dir=str(tmp_path / "cache"))
    assert str(path) in str(info.value) and message in str(info.value)


def test_missing_files_and_splits(tmp_path, tokenizer) -> None:
    (tmp_path / "p.txt").write_text("x")
    with pytest.raises(PromptDataError, match="unsupported file type '.txt'"):
        load_task("t", tokenizer, path=str(tmp_path / "p.txt"))
    path = _write("disk", tmp_path)
    with pytest.raises(PromptDataError, match="no split 'test' \\(splits: train\\)"):
        load_task("t", tokenizer, path=str(path), split="test", prompt_column="question", answer_column="solution")
    with pytest.raises(PromptDataError, match="no chat_template"):
        encode_prompts(datasets.Dataset.from_list([{"prompt": "x", "answer": "1"}]), object(), source="s",
                       apply_chat_template=True)


@pytest.mark.parametrize("name,content", [
    ("empty.jsonl", ""), ("blank.jsonl", "\n\n"), ("empty.json", "[]"), ("empty.parquet", None), ("disk", None),
])
def test_an_empty_dataset_is_one_line(tmp_path, tokenizer, name, content) -> None:
    """An empty file failed with datasets' own words ("StopIteration: ", "Instruction \"train\" corresponds to no
    data!", "An error occurred while generating the dataset"), an empty saved dataset with "no training prompts left
    (0 longer than max_prompt_length)"."""
    path = tmp_path / name
    if name == "disk":
        datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "x", "answer": "1"}]).select([])}) \
            .save_to_disk(str(path))
    elif content is None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), path)
    else:
        path.write_text(content)
    with pytest.raises(PromptDataError) as info:
        load_task("t", tokenizer, path=str(path), cache_dir=str(tmp_path / "cache"))
    assert str(info.value) in (f"{path}: no rows", f"{path}: no rows in split 'train'")


def test_a_split_a_file_does_not_have_is_refused(tmp_path, tokenizer) -> None:
    """A single file is one split, 'train': `split: test` was silently ignored and trained on the whole file."""
    rows = [{"prompt": f"{i} + 1", "answer": str(i + 1)} for i in range(4)]
    for kind in ("jsonl", "parquet"):
        path = _write(kind, tmp_path, rows)
        with pytest.raises(PromptDataError) as info:
            load_task("t", tokenizer, path=str(path), split="test", cache_dir=str(tmp_path / "cache"))
        assert str(info.value).startswith(f"{path}: no split 'test' (a single file holds one split, 'train')")
        task = load_task("t", tokenizer, path=str(path), split="train[:3]", cache_dir=str(tmp_path / "cache"))
        assert [p.answer for p in task.train] == ["1", "2", "3"]


# ---------------------------------------------------------------------------------------------------- mixture


def _builtin(name: str, kind: str, tokenizer, weight: float, size: int) -> Task:
    return load_task(name, tokenizer, kind=kind, weight=weight, train_size=size, seed=11)


def test_mixture_follows_weights_and_resumes_exactly(tokenizer) -> None:
    tasks = [_builtin("arith", "arithmetic", tokenizer, 3.0, 40), _builtin("count", "countdown", tokenizer, 1.0, 7),
             _builtin("off", "arithmetic", tokenizer, 0.0, 5)]
    mixture = TaskMixture(tasks, seed=0)
    drawn = mixture.take(400)
    for start in range(0, 400, 4):  # every window of 4 draws holds 3 arith and 1 count
        assert Counter(p.task for p in drawn[start:start + 4]) == {"arith": 3, "count": 1}
    # Each epoch of a task visits every prompt once, in a fresh order.
    count_rows = [p.index for p in drawn if p.task == "count"]
    assert all(sorted(count_rows[e * 7:(e + 1) * 7]) == list(range(7)) for e in range(100 // 7))
    assert count_rows[:7] != count_rows[7:14]

    again = TaskMixture(tasks, seed=0)
    head = again.take(137)
    state = json.loads(json.dumps(again.state_dict()))
    resumed = TaskMixture(tasks, seed=0)
    resumed.load_state_dict(state)
    assert [(p.task, p.index) for p in head + resumed.take(263)] == [(p.task, p.index) for p in drawn]
    assert [p.index for p in TaskMixture(tasks, seed=1).take(20)] != [p.index for p in drawn[:20]]

    # Any earlier draw can be replayed from (task, draw number) without moving the stream (async resume).
    positions = []
    replayer = TaskMixture(tasks, seed=0)
    for _ in range(30):
        next(replayer)
        positions.append(replayer.last_draw)
    replayed = [replayer.replay(task, count) for task, count in positions]
    assert [(p.task, p.index) for p in replayed] == [(p.task, p.index) for p in drawn[:30]]
    assert replayer.num_drawn == 30 and replayer.replay("count", 9).index == count_rows[9]  # a later epoch too
    with pytest.raises(ValueError, match="no task 'nope'"):
        replayer.replay("nope", 0)

    with pytest.raises(UserError, match="drawn from tasks"):
        TaskMixture(tasks[:2], seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="sum to > 0"):
        TaskMixture([tasks[2]])


def test_tasks_from_a_recipe_data_section(tmp_path, tokenizer) -> None:
    from slime_dsa.config.schema import DataSection

    path = _write("jsonl", tmp_path)
    data = DataSection(seed=4, max_prompt_length=200, apply_chat_template=True, tasks=[
        {"kind": "arithmetic", "weight": 2, "eval_size": 5},
        {"name": "qa", "kind": "dataset", "path": str(path), "prompt_column": "question", "answer_column": "solution",
         "reward_fn": "my_rewards_mod:exact", "eval_fraction": 0.25},
    ])
    tasks = build_tasks(data, tokenizer, train_size=30, cache_dir=str(tmp_path / "cache"))
    assert [(t.name, t.weight, t.reward_fn, len(t.train), len(t.eval)) for t in tasks] == [
        ("arithmetic", 2.0, "arithmetic", 30, 5), ("qa", 1.0, "my_rewards_mod:exact", 3, 1)]
    assert tasks[0].train[0].prompt_text.startswith("[gMASK]<sop><|user|>\nCompute ")
    assert [p.task for p in TaskMixture(tasks, seed=data.seed).take(6)] == ["arithmetic", "qa", "arithmetic"] * 2


def test_no_task_trains_on_another_tasks_eval_prompts(tokenizer) -> None:
    """An SFT mix of a 1-2 digit task (with eval) and a two-digit task (train only) shares problems: the
    two-digit task's copies of the eval prompts are dropped."""
    from slime_dsa.config.schema import DataSection

    data = DataSection(seed=7, apply_chat_template=True, tasks=[
        {"name": "mixed", "kind": "arithmetic", "eval_size": 60, "task_args": {"max_digits": 1, "ops": "+"}},
        {"name": "small", "kind": "arithmetic", "weight": 3, "task_args": {"max_digits": 1, "ops": "+"}},
    ])
    tasks = build_tasks(data, tokenizer, train_size=300)
    held_out = set(tasks[0].eval.dataset["prompt_text"])
    assert len(held_out) == 60  # of the 100 one-digit sums
    for task in tasks:
        assert not held_out & set(task.train.dataset["prompt_text"]), task.name
    assert tasks[1].num_dropped_duplicate > 0 and len(tasks[1].train) == 300 - tasks[1].num_dropped_duplicate


def test_prompt_to_sample(tokenizer) -> None:
    prompt = _builtin("arith", "arithmetic", tokenizer, 1.0, 3).train[0]
    sample = prompt.to_sample(index=12, group_id=4)
    assert sample.prompt_ids == prompt.prompt_ids and sample.answer == prompt.answer and sample.task == "arith"
    assert (sample.index, sample.group_id, sample.status) == (12, 4, SampleStatus.PENDING)
    assert sample.metadata == {"solution": prompt.metadata["solution"]}


@pytest.fixture(scope="module", autouse=True)
def _close_math_pool():
    yield
    get_math_verify_pool().close()
