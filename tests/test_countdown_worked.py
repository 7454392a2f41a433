"""Countdown with worked steps (task_args worked_steps, and worked_search's pair lines): the reference solution
reasons in <think> before its <answer>, every line is true arithmetic, the reward still reads the answer, and
recipes/gpu_single_sft_long.yaml's answers are long (>= 200 tokens on average with the built-in tokenizer)."""

from __future__ import annotations

import random
import re
import statistics
from collections import Counter
from pathlib import Path

import pytest

from rollout.rewards import countdown_reward
from rollout.rewards.countdown import parse_expression
from slime_dsa.data.task_params import PARAMS, task_params
from slime_dsa.data.tasks import TASKS, countdown_problem

ROOT = Path(__file__).resolve().parents[1]
_STEP = re.compile(r"step (\d+): (\d+) ([-+*/]) (\d+) = (\d+), left \[([\d, ]*)\]")
_CHECK = re.compile(r"check: (.+) = (\d+), the target")
_PAIR = re.compile(r"pair (\d+), (\d+): (.+)")
_RESULT = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a // b}


def worked_problems(n: int, seed: int = 0, **args) -> list[tuple[str, dict, str]]:
    rng, params = random.Random(seed), task_params("countdown", worked_steps=True, **args)
    return [countdown_problem(rng, params) for _ in range(n)]


def check_search(numbers: list[int], lines: list[str], ops: str) -> None:
    """The pair lines: one per pair of the numbers, each listing every allowed op that keeps a positive integer."""
    assert len(lines) == len(numbers) * (len(numbers) - 1) // 2
    pairs = Counter()
    for line in lines:
        a, b, results = _PAIR.fullmatch(line).groups()
        a, b = int(a), int(b)
        assert a >= b
        pairs[(a, b)] += 1
        listed = [] if results == "none" else [_RESULT.fullmatch(r).groups() for r in results.split(", ")]
        expected = [op for op in "+-*/" if op in ops and (op in "+*" or (op == "-" and a > b) or
                                                          (op == "/" and a % b == 0))]
        assert [op for _, op, _, _ in listed] == expected, line
        for x, op, y, value in listed:
            assert (int(x), int(y)) == (a, b) and _APPLY[op](a, b) == int(value) > 0, line
    assert pairs == Counter((max(x, y), min(x, y)) for i, x in enumerate(numbers) for y in numbers[i + 1:])


def check_worked_solution(answer: dict, solution: str, ops: str = "+-*/") -> None:
    """Every line of the <think> block is true and follows from the numbers; the answer is the checked expression."""
    think, rest = re.fullmatch(r"<think>\n(.*)\n</think>\n(<answer>.*</answer>)", solution, re.DOTALL).groups()
    header, *steps, check = think.split("\n")
    assert header == f"Numbers {answer['numbers']}, target {answer['target']}."
    search = [line for line in steps if line.startswith("pair ")]
    steps = steps[len(search):]
    if search:
        check_search(answer["numbers"], search, ops)
    pool = Counter(answer["numbers"])
    for k, line in enumerate(steps, 1):
        number, a, op, b, value, left = _STEP.fullmatch(line).groups()
        a, b, value = int(a), int(b), int(value)
        assert int(number) == k and _APPLY[op](a, b) == value and value > 0, line
        assert op != "/" or a % b == 0, line
        pool -= Counter([a, b])
        assert pool[a] >= 0 and pool[b] >= 0
        pool[value] += 1
        assert Counter(int(x) for x in left.split(", ")) == +pool, line
    assert +pool == Counter([answer["target"]])  # every number combined, into the target
    expression, target = _CHECK.fullmatch(check).groups()
    assert int(target) == answer["target"] and rest == f"<answer>{expression}</answer>"
    value, used = parse_expression(expression)
    assert value == answer["target"] and Counter(used) == Counter(answer["numbers"])


@pytest.mark.parametrize("args", [{}, {"min_numbers": 5, "max_numbers": 6}, {"use_all": True, "ops": "+-*"},
                                  {"min_numbers": 2, "max_numbers": 8, "max_number": 9},
                                  {"min_numbers": 3, "max_numbers": 3, "worked_search": True},
                                  {"min_numbers": 2, "max_numbers": 5, "ops": "+/", "worked_search": True},
                                  {"max_number": 3, "ops": "-/", "worked_search": True}])
def test_worked_solutions_are_true_and_score_one(args) -> None:
    for prompt, answer, solution in worked_problems(300, seed=len(args), **args):
        check_worked_solution(answer, solution, args.get("ops", "+-*/"))
        assert ("\npair " in solution) == args.get("worked_search", False)
        scores = countdown_reward(None, solution, answer)
        assert scores == {"reward": 1.0, "answer_found": 1.0, "answer_tagged": 1.0}, solution
        assert "<answer>" not in solution.split("</think>")[0]  # the think block cannot be taken for the answer


def test_worked_steps_change_only_the_solution() -> None:
    plain_rng, worked_rng = random.Random(3), random.Random(3)
    plain_params, worked_params = task_params("countdown"), task_params("countdown", worked_steps=True)
    for _ in range(200):
        prompt, answer, solution = countdown_problem(plain_rng, plain_params)
        worked = countdown_problem(worked_rng, worked_params)
        assert worked[:2] == (prompt, answer) and worked[2].endswith("</think>\n" + solution)


def test_a_wrong_worked_answer_scores_zero() -> None:
    _, answer, solution = worked_problems(1)[0]
    wrong = solution.replace("</answer>", " + 1</answer>")
    assert countdown_reward(None, wrong, answer)["reward"] == 0.0


def test_long_recipe_answers_average_200_tokens_and_fit_its_limits() -> None:
    """The SFT targets of recipes/gpu_single_sft_long.yaml, as `slime-dsa sft` tokenizes them (+ EOS)."""
    import yaml

    from slime_dsa.data.tokenizer import build_tokenizer

    recipe = yaml.safe_load((ROOT / "recipes/gpu_single_sft_long.yaml").read_text())
    task = recipe["data"]["tasks"][0]
    tokenizer = build_tokenizer()
    problems = worked_problems(1000, **{k: v for k, v in task["task_args"].items() if k != "worked_steps"})
    lengths = [len(tokenizer.encode(s, add_special_tokens=False)) + 1 for _, _, s in problems]
    prompts = [len(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                                  add_generation_prompt=True),
                                    add_special_tokens=False)) for p, _, _ in problems]
    assert task["task_args"]["worked_steps"] is True
    assert statistics.mean(lengths) >= 200 and statistics.median(lengths) >= 200, statistics.mean(lengths)
    assert max(lengths) <= recipe["rollout"]["max_response_length"]
    assert max(prompts) <= recipe["data"]["max_prompt_length"]
    # dense attention over every sequence (SFT does not train the indexer)
    assert max(p + n for p, n in zip(prompts, lengths)) <= recipe["model"]["index_topk"]

def test_params_are_the_generators_and_types_are_checked() -> None:
    assert {kind: spec.params_cls for kind, spec in TASKS.items()} == PARAMS
    with pytest.raises(ValueError, match=r"worked_steps \('yes'\) must be of type bool"):
        task_params("countdown", worked_steps="yes")
    with pytest.raises(ValueError, match=r"max_numbers \(True\) must be of type int"):
        task_params("countdown", max_numbers=True)
    with pytest.raises(ValueError, match="unknown task parameter 'num_count'"):
        task_params("countdown", num_count=4)
    assert task_params("countdown", worked_steps=True, max_numbers=6).worked_steps is True
    with pytest.raises(ValueError, match=r"worked_search \(True\) .* needs worked_steps true"):
        task_params("countdown", worked_search=True)
