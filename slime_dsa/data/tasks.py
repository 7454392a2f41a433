"""Built-in synthetic verifiable tasks, generated deterministically from a seed as HF `datasets`.

- `arithmetic`: multi-digit addition/subtraction ("Compute 47 + 385. ..." → "432"). Difficulty knobs:
  `max_digits` (main one), `num_operands`, `allow_negative`.
- `countdown`: reach a target with the given numbers, each used at most once (`use_all` = exactly once), +-*/;
  `worked_steps`: the solution works the combinations out in `<think>` before its `<answer>` (long answers);
  `worked_search`: that `<think>` first lists every pair of the given numbers combined by each allowed op.
- `sort`: list the given numbers from smallest to largest ("Sort 42, 7, 19 from smallest to largest. ..." →
  "7, 19, 42"); knobs `min_numbers`, `max_numbers`, `max_number`.
- `calc_chain` (agentic): a chain of operations on a start number, one calculator call per step.
- `fact_lookup` (agentic): a sum or difference of two towns' populations from the fictional fact corpus
  (`slime_dsa.data.facts`): two searches, then one calculator call.

Parameters: `slime_dsa.data.task_params` (light, so `recipe check` validates `task_args`).
Rows: `prompt` (a self-contained user message, str), `answer` (ground truth for the task's reward function in
`rollout/rewards`) and `solution` (a reference response that the reward scores 1.0, for SFT warm-up and tests). An
agentic task's solution is a trajectory: a list of {"role": "assistant" | "tool", "content": str} turns whose
assistant turns call the task's `tools` in GLM's format (`slime_dsa.data.tool_calls`) and whose tool turns are what
those tools return.
Answer convention, shared by all verifiers: the response ends with its answer, optionally inside
`<answer>...</answer>`; the last tagged answer wins, else the verifier reads the end of the response.
Splits: the eval problems (distinct) are drawn first from the seed's stream, then train takes the next problems whose
prompt is not in eval, so train and eval never share a prompt and the eval split does not depend on train_size.
Train prompts may repeat, so that train follows the generator's distribution as eval does: requiring distinct train
prompts skews a small problem space (1-2 digit arithmetic has 20,000 problems; 15,000 distinct train prompts were
76% two-by-two-digit problems against 28% of eval, whose problems follow the generator).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets

from slime_dsa.data import facts
from slime_dsa.data.task_params import (
    ArithmeticParams,
    CalcChainParams,
    CountdownParams,
    FactLookupParams,
    SortParams,
    task_params,
)
from slime_dsa.data.tool_calls import render_tool_call

ANSWER_INSTRUCTION = "Put the final answer in <answer></answer>."
DEFAULT_TRAIN_SIZE = 20_000


Problem = tuple[str, Any, Any]  # (prompt, answer, solution: a response string, or a list of turns for agentic tasks)


def _random_number(rng: random.Random, digits: int) -> int:
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def arithmetic_problem(rng: random.Random, params: ArithmeticParams) -> Problem:
    """One addition/subtraction problem; the answer is the result as a decimal string."""
    while True:
        operands = [_random_number(rng, rng.randint(params.min_digits, params.max_digits))
                    for _ in range(params.num_operands)]
        ops = [rng.choice(params.ops) for _ in range(params.num_operands - 1)]
        value = operands[0]
        for op, x in zip(ops, operands[1:]):
            value = value + x if op == "+" else value - x
        if value >= 0 or params.allow_negative:
            break
    expression = str(operands[0]) + "".join(f" {op} {x}" for op, x in zip(ops, operands[1:]))
    return f"Compute {expression}. {ANSWER_INSTRUCTION}", str(value), f"<answer>{value}</answer>"


def _combine(rng: random.Random, a: int, b: int, ops: str) -> tuple[str, int] | None:
    """A random op that keeps every intermediate a positive integer (the countdown convention), or None."""
    choices = list(ops)
    rng.shuffle(choices)
    for op in choices:
        if op == "+":
            return op, a + b
        if op == "*":
            return op, a * b
        if op == "-" and a > b:
            return op, a - b
        if op == "/" and a % b == 0:
            return op, a // b
    return None


def _pair_results(numbers: list[int], ops: str) -> list[str]:
    """One line per pair of the given numbers (by position): each allowed op on it that keeps a positive integer,
    larger number first."""
    lines = []
    for i in range(len(numbers)):
        for j in range(i + 1, len(numbers)):
            a, b = max(numbers[i], numbers[j]), min(numbers[i], numbers[j])
            results = [f"{a} {op} {b} = {value}" for op, value in (("+", a + b), ("-", a - b), ("*", a * b),
                                                                  ("/", a // b if a % b == 0 else 0))
                       if op in ops and value > 0]
            lines.append(f"pair {a}, {b}: " + (", ".join(results) or "none"))
    return lines


def countdown_problem(rng: random.Random, params: CountdownParams) -> Problem:
    """Draw numbers, combine all of them in a random expression tree, and use its value as the target."""
    while True:
        count = rng.randint(params.min_numbers, params.max_numbers)
        numbers = [rng.randint(1, params.max_number) for _ in range(count)]
        items: list[tuple[str, int, bool]] = [(str(n), n, True) for n in numbers]  # (text, value, is_leaf)
        steps: list[str] = []
        while len(items) > 1:
            i, j = rng.sample(range(len(items)), 2)
            (ta, va, la), (tb, vb, lb) = items[i], items[j]
            combined = _combine(rng, va, vb, params.ops)
            if combined is None:
                break
            op, value = combined
            text = f"{ta if la else f'({ta})'} {op} {tb if lb else f'({tb})'}"
            items = [item for k, item in enumerate(items) if k not in (i, j)] + [(text, value, False)]
            steps.append(f"step {len(steps) + 1}: {va} {op} {vb} = {value}, left {[v for _, v, _ in items]}")
        if len(items) > 1:
            continue
        expression, target, _ = items[0]
        # A target equal to one of the numbers has a one-number solution: too easy to teach anything.
        if 1 <= target <= params.max_target and target not in numbers:
            break
    rule = "each number must be used exactly once" if params.use_all else "each number can only be used once"
    ops_text = ", ".join(params.ops)
    prompt = (f"Using the numbers {numbers}, create an equation that equals {target}. "
              f"You can use basic arithmetic operations ({ops_text}) and {rule}. {ANSWER_INSTRUCTION}")
    answer = {"target": target, "numbers": numbers, "use_all": params.use_all}
    solution = f"<answer>{expression}</answer>"
    if params.worked_steps:
        search = _pair_results(numbers, params.ops) if params.worked_search else []
        lines = [f"Numbers {numbers}, target {target}.", *search, *steps,
                 f"check: {expression} = {target}, the target"]
        solution = "<think>\n" + "\n".join(lines) + "\n</think>\n" + solution
    return prompt, answer, solution


def sort_problem(rng: random.Random, params: SortParams) -> Problem:
    """Numbers in random order; the answer is the sorted list, written comma-separated."""
    numbers = [rng.randint(0, params.max_number) for _ in range(rng.randint(params.min_numbers, params.max_numbers))]
    ordered = ", ".join(str(n) for n in sorted(numbers))
    prompt = f"Sort {', '.join(str(n) for n in numbers)} from smallest to largest. {ANSWER_INSTRUCTION}"
    return prompt, sorted(numbers), f"<answer>{ordered}</answer>"


_STEP_WORDS = {"+": "add {x}", "-": "subtract {x}", "*": "multiply by {x}"}


def _call_turn(tool: str, **arguments: Any) -> dict[str, str]:
    return {"role": "assistant", "content": render_tool_call(tool, arguments)}


def calc_chain_problem(rng: random.Random, params: CalcChainParams) -> Problem:
    """Start with x, then apply each step; the solution calls the calculator once per step."""
    start = value = _random_number(rng, params.start_digits)
    steps, turns = [], []
    for _ in range(rng.randint(params.min_steps, params.max_steps)):
        op = rng.choice(params.ops)
        x = _random_number(rng, max(1, params.operand_digits - (op == "*"))) + (op == "*") * 2  # never * 0 or * 1
        steps.append(_STEP_WORDS[op].format(x=x))
        turns.append(_call_turn("calculator", expression=f"{value} {op} {x}"))
        value = {"+": value + x, "-": value - x, "*": value * x}[op]
        turns.append({"role": "tool", "content": str(value)})
    turns.append({"role": "assistant", "content": f"<answer>{value}</answer>"})
    prompt = f"Start with {start}, then {', then '.join(steps)}. Use the calculator for each step. {ANSWER_INSTRUCTION}"
    return prompt, str(value), turns


def fact_lookup_problem(rng: random.Random, params: FactLookupParams) -> Problem:
    """The sum or difference of two towns' populations: two searches and a calculator call."""
    a, b = rng.sample(facts.towns(), 2)
    if rng.choice(params.questions.split(",")) == "sum":
        question, expression, value = (f"How many people live in {a.name} and {b.name} together?",
                                       f"{a.population} + {b.population}", a.population + b.population)
    else:
        a, b = (a, b) if a.population >= b.population else (b, a)
        question, expression, value = (f"How many more people live in {a.name} than in {b.name}?",
                                       f"{a.population} - {b.population}", a.population - b.population)
    turns = [_call_turn("search", query=f"{a.name} population"), {"role": "tool", "content": facts.document(a)},
             _call_turn("search", query=f"{b.name} population"), {"role": "tool", "content": facts.document(b)},
             _call_turn("calculator", expression=expression), {"role": "tool", "content": str(value)},
             {"role": "assistant", "content": f"<answer>{value}</answer>"}]
    prompt = f"{question} Use the search tool, then the calculator. {ANSWER_INSTRUCTION}"
    return prompt, str(value), turns


@dataclass(frozen=True)
class TaskSpec:
    """A built-in task: its parameters, its problem generator, and the reward function that verifies it."""

    name: str
    params_cls: type
    make_problem: Callable[[random.Random, Any], Problem]
    reward: str  # name in rollout.rewards' registry
    tools: tuple[str, ...] = ()  # tools the reference solutions call (an agentic task); () = single turn


TASKS: dict[str, TaskSpec] = {
    "arithmetic": TaskSpec("arithmetic", ArithmeticParams, arithmetic_problem, reward="arithmetic"),
    "countdown": TaskSpec("countdown", CountdownParams, countdown_problem, reward="countdown"),
    "sort": TaskSpec("sort", SortParams, sort_problem, reward="sort"),
    "calc_chain": TaskSpec("calc_chain", CalcChainParams, calc_chain_problem, reward="tool_answer",
                           tools=("calculator",)),
    "fact_lookup": TaskSpec("fact_lookup", FactLookupParams, fact_lookup_problem, reward="tool_answer",
                            tools=("search", "calculator")),
}


def get_task(kind: str) -> TaskSpec:
    """The built-in task called `kind`; a clear error lists the others."""
    if kind not in TASKS:
        raise ValueError(f"unknown built-in task {kind!r}; expected one of {sorted(TASKS)}")
    return TASKS[kind]


def generate_problems(kind: str, n: int, rng: random.Random, params: Any, seen: set[str],
                      distinct: bool = True) -> list[dict[str, Any]]:
    """`n` rows whose prompts are not in `seen`; distinct: no prompt twice (and `seen` is updated). Raises if the
    problem space runs dry."""
    spec = get_task(kind)
    rows: list[dict[str, Any]] = []
    attempts, max_attempts = 0, 50 * n + 1000
    while len(rows) < n:
        if attempts >= max_attempts:
            what = "new distinct" if distinct else "new"
            raise ValueError(f"{kind}: found only {len(rows)} {what} problems of {n} requested with "
                             f"{params}; widen the parameters or ask for fewer prompts")
        attempts += 1
        prompt, answer, solution = spec.make_problem(rng, params)
        if prompt in seen:
            continue
        if distinct:
            seen.add(prompt)
        rows.append({"prompt": prompt, "answer": answer, "solution": solution})
    return rows


def build_task_splits(
    kind: str, *, train_size: int = DEFAULT_TRAIN_SIZE, eval_size: int = 0, seed: int = 0, **params: Any,
) -> datasets.DatasetDict:
    """Deterministic `train` and `eval` splits of a built-in task (columns prompt, answer, solution); eval prompts
    are distinct, train prompts may repeat (both follow the generator's distribution)."""
    if train_size < 0 or eval_size < 0:
        raise ValueError(f"{kind}: train_size ({train_size}) and eval_size ({eval_size}) must be >= 0")
    parsed = task_params(kind, **params)
    rng = random.Random(f"slime-dsa:{kind}:{seed}")  # a str seed is hashed with sha512: stable across processes
    seen: set[str] = set()
    eval_rows = generate_problems(kind, eval_size, rng, parsed, seen)
    train_rows = generate_problems(kind, train_size, rng, parsed, seen, distinct=False)
    return datasets.DatasetDict({"train": _to_dataset(train_rows), "eval": _to_dataset(eval_rows)})


def _to_dataset(rows: list[dict[str, Any]]) -> datasets.Dataset:
    return datasets.Dataset.from_dict({key: [row[key] for row in rows] for key in ("prompt", "answer", "solution")})
