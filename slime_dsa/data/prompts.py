"""Prompt datasets for the RL loop: load, check, template, tokenize, split, and mix several tasks by weight.

Sources (HF `datasets`, never a download of ours): a JSONL/JSON or Parquet file, a folder written by
`save_to_disk` (a `DatasetDict` picks `split`), a folder of data files, a Hub id already in the local cache, or a
built-in task (`slime_dsa.data.tasks`).
Prompt column: a string, or a list of chat messages ({"role", "content"}). Chat messages always go through the
tokenizer's chat template; strings do when `apply_chat_template` is set (as one user turn). `system_prompt`, if
given, is prepended as a system message (unless the row's messages start with one), or, without the template,
as a paragraph before the prompt text. Templated text is tokenized without adding special tokens (the template
wrote them); raw text is tokenized as it is.
Prompts longer than `max_prompt_length` tokens are dropped, counted and logged. The eval split holds out rows
(`eval_size` rows or an `eval_fraction`) chosen from the seed; train rows whose prompt text also appears in eval
are dropped, so the two never share a prompt.
"""

from __future__ import annotations

import json

import logging
import math
import sys
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from slime_dsa.config.errors import UserError
from slime_dsa.data import tasks as builtin_tasks
from slime_dsa.data.sample import Sample

logger = logging.getLogger(__name__)

ADDED_COLUMNS = ("prompt_text", "prompt_ids", "source_row")
DEFAULT_DATASET_REWARD = "math_verify"  # reward of kind "dataset" when none is named
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class PromptDataError(UserError, ValueError):
    """A prompt source is unusable; the one-line message names the source, and the row and column if any."""


# ---------------------------------------------------------------------------------------------------- loading


def load_prompt_dataset(path: str | Path, *, split: str = "train", cache_dir: str | None = None) -> datasets.Dataset:
    """Rows of a JSONL/JSON/Parquet file, a `save_to_disk` folder, a folder of data files, or a cached Hub dataset."""
    p = Path(path)
    try:
        if p.is_dir() and any((p / name).exists() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
            loaded = datasets.load_from_disk(str(p))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise PromptDataError(f"{path}: no split {split!r} (splits: {', '.join(loaded)}); set split")
                loaded = loaded[split]
            return loaded
        if p.is_file():
            builder = _FILE_BUILDERS.get(p.suffix.lower())
            if builder is None:
                raise PromptDataError(f"{path}: unsupported file type {p.suffix!r}; expected .jsonl, .json or .parquet")
            if split.partition("[")[0] != "train":  # a file is one split; a slice of it ("train[:100]") is fine
                raise PromptDataError(f"{path}: no split {split!r} (a single file holds one split, 'train'); set split "
                                      "to train, or path to a folder with one file per split")
            return datasets.load_dataset(builder, data_files=str(p), split=split, cache_dir=cache_dir)
        if p.is_dir():
            return datasets.load_dataset(str(p), split=split, cache_dir=cache_dir)
        # Not a local path: a Hub id, read from the local cache when HF_HUB_OFFLINE=1.
        return datasets.load_dataset(str(path), split=split, cache_dir=cache_dir)
    except PromptDataError:
        raise
    except Exception as exc:
        if where := _bad_json_row(p) or _no_rows(p, split):  # datasets' own message names no row
            raise PromptDataError(f"{path}: {where}") from exc
        raise PromptDataError(f"{path}: cannot load prompts ({type(exc).__name__}: {exc})") from exc


def _bad_json_row(path: Path) -> str | None:
    """'row N: not valid JSON (...)' for the first line of a .jsonl file that does not parse as a JSON object."""
    if path.suffix.lower() != ".jsonl" or not path.is_file():
        return None
    with path.open("rb") as f:
        for row, line in enumerate(f):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as e:
                return f"row {row}: not valid JSON ({getattr(e, 'msg', e)})"
            if not isinstance(value, dict):
                return f"row {row}: expected a JSON object, got {type(value).__name__}"
    return None


def _no_rows(path: Path, split: str) -> str | None:
    """'no rows' for a data file or a `save_to_disk` folder that holds none (datasets fails on those with
    StopIteration, "no data", "An error occurred while generating the dataset" or an IndexError)."""
    for state in (path / "state.json", path / split / "state.json"):
        try:
            if state.is_file() and json.loads(state.read_text()).get("_data_files") == []:
                return "no rows" if state.parent == path else f"no rows in split {split!r}"
        except (OSError, ValueError, AttributeError):
            return None
    if not path.is_file():
        return None
    if path.suffix.lower() == ".parquet":
        try:
            return "no rows" if pq.read_metadata(path).num_rows == 0 else None
        except (OSError, pa.ArrowException):
            return None
    with path.open("rb") as f:
        head = f.read(1 << 16).strip()
    return "no rows" if head in (b"", b"[]") and path.stat().st_size < (1 << 16) else None


def _check_utf8(ds: datasets.Dataset, source: str) -> None:
    """Arrow keeps a file's bytes as they are; name the first row whose text is not UTF-8 before anything reads it."""
    offset = 0
    for batch in ds.with_format("arrow").iter(batch_size=10_000):
        for name in batch.column_names:
            column = batch[name]
            try:
                column.validate(full=True)
                continue
            except pa.ArrowInvalid:
                pass
            for row in range(len(column)):
                try:
                    column[row].as_py()
                except UnicodeDecodeError as exc:
                    raise PromptDataError(f"{source}: row {offset + row}, column {name!r}: not valid UTF-8 (byte "
                                          f"0x{exc.object[exc.start]:02x} at position {exc.start} of the text)") from None
        offset += batch.num_rows


def _check_columns(ds: datasets.Dataset, source: str, prompt_column: str, answer_column: str | None) -> None:
    for key, column in (("prompt_column", prompt_column), ("answer_column", answer_column)):
        if column is not None and column not in ds.column_names:
            raise PromptDataError(f"{source}: no column {column!r} (columns: {', '.join(ds.column_names)}); "
                                  f"set {key}")
    reserved = [c for c in ADDED_COLUMNS if c in ds.column_names]
    if reserved:
        raise PromptDataError(f"{source}: column {reserved[0]!r} is reserved for the tokenized prompt; rename it")


# ---------------------------------------------------------------------------------------------------- formatting


def _check_messages(value: Any) -> str | None:
    """Why `value` is not a list of chat messages, or None if it is one."""
    if not value:
        return "an empty list of messages"
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"message {i} is {type(message).__name__}, not a dict"
        if not isinstance(message.get("role"), str):
            return f"message {i} has no string 'role'"
        if not isinstance(message.get("content"), (str, list, type(None))):
            return f"message {i} has 'content' of type {type(message.get('content')).__name__}"
    return None


def format_prompt(
    prompt: str | list[dict[str, Any]], tokenizer: Any, *, apply_chat_template: bool, system_prompt: str | None = None,
) -> str:
    """The text a prompt becomes before tokenization (the conventions are in the module docstring)."""
    if isinstance(prompt, str) and not apply_chat_template:
        return f"{system_prompt}\n\n{prompt}" if system_prompt else prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode_prompts(
    ds: datasets.Dataset, tokenizer: Any, *, source: str, prompt_column: str = "prompt",
    answer_column: str | None = "answer", apply_chat_template: bool = False, system_prompt: str | None = None,
) -> datasets.Dataset:
    """Check every row and add `prompt_text`, `prompt_ids` and `source_row` (the row's index in `ds`)."""
    _check_columns(ds, source, prompt_column, answer_column)
    _check_utf8(ds, source)
    if (apply_chat_template or _has_messages(ds, prompt_column)) and not getattr(tokenizer, "chat_template", None):
        raise PromptDataError(f"{source}: the tokenizer has no chat_template; set apply_chat_template: false and use "
                              "string prompts")
    ds = ds.add_column("source_row", list(range(len(ds))))

    def encode(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        texts = []
        answers = batch[answer_column] if answer_column is not None else [True] * len(batch[prompt_column])
        for prompt, answer, row in zip(batch[prompt_column], answers, batch["source_row"]):
            where = f"{source}: row {row}, column"
            if answer is None:
                raise PromptDataError(f"{where} {answer_column!r}: missing value")
            if isinstance(prompt, str):
                if not prompt.strip():
                    raise PromptDataError(f"{where} {prompt_column!r}: empty prompt")
            elif isinstance(prompt, list):
                problem = _check_messages(prompt)
                if problem:
                    raise PromptDataError(f"{where} {prompt_column!r}: expected chat messages, got {problem}")
            else:
                raise PromptDataError(f"{where} {prompt_column!r}: expected a string or a list of chat messages, "
                                      f"got {type(prompt).__name__}")
            try:
                texts.append(format_prompt(prompt, tokenizer, apply_chat_template=apply_chat_template,
                                           system_prompt=system_prompt))
            except Exception as exc:
                raise PromptDataError(f"{where} {prompt_column!r}: chat template failed ({exc})") from exc
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return {"prompt_text": texts, "prompt_ids": ids}

    with _bars_on_a_terminal_only():
        return ds.map(encode, batched=True, batch_size=1000, keep_in_memory=True, load_from_cache_file=False,
                      desc=f"tokenizing {source}")


@contextmanager
def _bars_on_a_terminal_only() -> Iterator[None]:
    """datasets' progress bars off while stderr is no terminal (a pipe, a log file would get their carriage returns),
    then as they were."""
    if sys.stderr.isatty() or datasets.are_progress_bars_disabled():
        yield
        return
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.enable_progress_bars()


def _has_messages(ds: datasets.Dataset, column: str) -> bool:
    return len(ds) > 0 and isinstance(ds[0][column], list)


def _prompt_lengths(ds: datasets.Dataset) -> np.ndarray:
    return pc.list_value_length(ds.with_format("arrow")["prompt_ids"]).to_numpy(zero_copy_only=False)


def drop_long_prompts(ds: datasets.Dataset, max_prompt_length: int, *, source: str) -> tuple[datasets.Dataset, int]:
    """Rows whose prompt fits in `max_prompt_length` tokens, and how many were dropped (logged)."""
    if len(ds) == 0:
        return ds, 0
    lengths = _prompt_lengths(ds)
    keep = np.flatnonzero(lengths <= max_prompt_length)
    dropped = len(ds) - len(keep)
    if dropped:
        logger.warning("%s: dropped %d of %d prompts longer than max_prompt_length=%d tokens (longest %d)",
                       source, dropped, len(ds), max_prompt_length, int(lengths.max()))
        ds = ds.select(keep)
    return ds, dropped


# ---------------------------------------------------------------------------------------------------- prompts


@dataclass
class Prompt:
    """One tokenized prompt of a task, ready to be sampled n times."""

    task: str
    split: str
    index: int  # row in the source (file / generated split): a stable id for logs
    prompt_ids: list[int]
    prompt_text: str
    answer: Any
    metadata: dict[str, Any] = field(default_factory=dict)  # the source's other columns

    def to_sample(self, *, index: int, group_id: int | None = None) -> Sample:
        """A fresh Sample of this prompt (`index` is the sample's unique id)."""
        return Sample(prompt_ids=list(self.prompt_ids), prompt_text=self.prompt_text, answer=self.answer,
                      task=self.task, index=index, group_id=group_id, metadata=dict(self.metadata))


class PromptSet:
    """The tokenized prompts of one task's split, indexable as `Prompt`s."""

    def __init__(self, task: str, split: str, dataset: datasets.Dataset, *, prompt_column: str = "prompt",
                 answer_column: str | None = "answer") -> None:
        self.task, self.split, self.dataset = task, split, dataset
        self.prompt_column, self.answer_column = prompt_column, answer_column
        self._skip = {prompt_column, answer_column, *ADDED_COLUMNS}

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Prompt:
        row = self.dataset[int(i)]
        return Prompt(
            task=self.task, split=self.split, index=row["source_row"], prompt_ids=row["prompt_ids"],
            prompt_text=row["prompt_text"], answer=row[self.answer_column] if self.answer_column else None,
            metadata={k: v for k, v in row.items() if k not in self._skip},
        )

    def __iter__(self) -> Iterator[Prompt]:
        return (self[i] for i in range(len(self)))


@dataclass
class Task:
    """A named prompt source: train and eval prompts, its weight in the mixture, and its reward function."""

    name: str
    kind: str
    weight: float
    reward_fn: str  # a registered name or "package.module:function" (resolved by rollout.rewards)
    train: PromptSet
    eval: PromptSet | None
    num_dropped_too_long: dict[str, int] = field(default_factory=dict)
    num_dropped_duplicate: int = 0  # train rows dropped because their prompt is in eval
    agent: Any = None  # slime_dsa.config.schema.AgentConfig: rollouts are multi-turn tool-using trajectories


def _eval_count(n: int, eval_size: int, eval_fraction: float) -> int:
    if eval_size:
        return eval_size
    return min(n, max(1, round(eval_fraction * n))) if eval_fraction > 0 and n else 0


def _split_rows(n: int, n_eval: int, seed: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, eval rows), each in source order; which rows go to eval depends only on (seed, name, n)."""
    perm = np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, zlib.crc32(name.encode())]).permutation(n)
    return np.sort(perm[n_eval:]), np.sort(perm[:n_eval])


def load_task(
    name: str, tokenizer: Any, *, kind: str = "dataset", path: str | None = None, split: str = "train",
    prompt_column: str = "prompt", answer_column: str | None = "answer", system_prompt: str | None = None,
    reward_fn: str | None = None, weight: float = 1.0, eval_size: int = 0, eval_fraction: float = 0.0,
    apply_chat_template: bool = False, max_prompt_length: int = 512, seed: int = 0,
    train_size: int = builtin_tasks.DEFAULT_TRAIN_SIZE, task_args: dict[str, Any] | None = None,
    cache_dir: str | None = None, agent: Any = None,
) -> Task:
    """Load, check, tokenize and split one task. Built-in kinds generate `train_size` prompts from `task_args`.
    `agent` (an AgentConfig) makes its rollouts tool-using trajectories; an agentic built-in kind gets the glm loop
    with its tools when none is given."""
    encode_kwargs = dict(prompt_column=prompt_column, answer_column=answer_column,
                         apply_chat_template=apply_chat_template, system_prompt=system_prompt)
    if kind == "dataset":
        if path is None:
            raise PromptDataError(f"task {name!r}: kind 'dataset' needs a path")
        if task_args:
            raise PromptDataError(f"task {name!r}: task_args ({sorted(task_args)}) only apply to built-in tasks")
        source = str(path)
        raw = load_prompt_dataset(path, split=split, cache_dir=cache_dir)
        if len(raw) == 0:
            raise PromptDataError(f"{source}: no rows in split {split!r}")
        encoded = encode_prompts(raw, tokenizer, source=source, **encode_kwargs)
        n_eval = _eval_count(len(encoded), eval_size, eval_fraction)
        if n_eval >= len(encoded) > 0:
            raise PromptDataError(f"task {name!r}: the eval split would take all {len(encoded)} prompts of {source}")
        train_rows, eval_rows = _split_rows(len(encoded), n_eval, seed, name)
        train_ds, eval_ds = encoded.select(train_rows), encoded.select(eval_rows)
        default_reward = DEFAULT_DATASET_REWARD
    else:
        spec = builtin_tasks.get_task(kind)
        source = f"built-in task {name!r} ({kind})"
        n_eval = _eval_count(train_size, eval_size, eval_fraction)
        splits = builtin_tasks.build_task_splits(kind, train_size=train_size, eval_size=n_eval, seed=seed,
                                                 **(task_args or {}))
        train_ds = encode_prompts(splits["train"], tokenizer, source=f"{source} train", **encode_kwargs)
        eval_ds = encode_prompts(splits["eval"], tokenizer, source=f"{source} eval", **encode_kwargs)
        default_reward = spec.reward
        if agent is None and spec.tools:
            from slime_dsa.config.schema import AgentConfig  # noqa: PLC0415

            agent = AgentConfig(tools=list(spec.tools))

    train_ds, train_long = drop_long_prompts(train_ds, max_prompt_length, source=f"{source} (train)")
    eval_ds, eval_long = drop_long_prompts(eval_ds, max_prompt_length, source=f"{source} (eval)")
    duplicates = 0
    if len(eval_ds):
        eval_texts = set(eval_ds["prompt_text"])
        keep = [i for i, text in enumerate(train_ds["prompt_text"]) if text not in eval_texts]
        duplicates = len(train_ds) - len(keep)
        if duplicates:
            logger.warning("%s: dropped %d train prompts that also appear in the eval split", source, duplicates)
            train_ds = train_ds.select(keep)
    if weight > 0 and len(train_ds) == 0:
        raise PromptDataError(f"task {name!r}: no training prompts left from {source} "
                              f"({train_long} longer than max_prompt_length={max_prompt_length})")
    logger.info("task %r: %d train / %d eval prompts from %s", name, len(train_ds), len(eval_ds), source)
    columns = dict(prompt_column=prompt_column, answer_column=answer_column)
    return Task(
        name=name, kind=kind, weight=weight, reward_fn=reward_fn or default_reward,
        train=PromptSet(name, "train", train_ds, **columns),
        eval=PromptSet(name, "eval", eval_ds, **columns) if len(eval_ds) else None,
        num_dropped_too_long={"train": train_long, "eval": eval_long}, num_dropped_duplicate=duplicates, agent=agent,
    )


def build_tasks(data: Any, tokenizer: Any, *, train_size: int | None = None, cache_dir: str | None = None) -> list[Task]:
    """The tasks of a recipe's `data` section (`slime_dsa.config` DataSection); `train_size` overrides each task's.

    Train prompts that appear in any task's eval split are dropped, so that a task mixed in for training (say an
    SFT mix of harder problems) never trains on another task's held-out prompts."""
    tasks = [
        load_task(
            t.name, tokenizer, kind=t.kind, path=t.path, split=t.split, prompt_column=t.prompt_column,
            answer_column=t.answer_column, reward_fn=t.reward_fn, weight=t.weight, eval_size=t.eval_size,
            eval_fraction=t.eval_fraction, apply_chat_template=data.apply_chat_template,
            max_prompt_length=data.max_prompt_length, seed=data.seed, cache_dir=cache_dir,
            train_size=train_size or getattr(t, "train_size", builtin_tasks.DEFAULT_TRAIN_SIZE), task_args=dict(getattr(t, "task_args", {}) or {}) or None,
            system_prompt=getattr(t, "system_prompt", None), agent=getattr(t, "agent", None),
        )
        for t in data.tasks
    ]
    eval_texts = {text for t in tasks if t.eval is not None for text in t.eval.dataset["prompt_text"]}
    for task in tasks:
        keep = [i for i, text in enumerate(task.train.dataset["prompt_text"]) if text not in eval_texts]
        dropped = len(task.train) - len(keep)
        if dropped:
            logger.warning("task %r: dropped %d train prompts that appear in another task's eval split", task.name, dropped)
            task.train = PromptSet(task.name, "train", task.train.dataset.select(keep),
                                   prompt_column=task.train.prompt_column, answer_column=task.train.answer_column)
            task.num_dropped_duplicate += dropped
        if task.weight > 0 and len(task.train) == 0:
            raise PromptDataError(f"task {task.name!r}: every training prompt is in another task's eval split")
    return tasks


# ---------------------------------------------------------------------------------------------------- mixture


class TaskMixture:
    """An endless, deterministic stream of training prompts from several tasks, mixed by weight, resumable.

    Which task: the one furthest below its share so far (largest `weight_i * (drawn + 1) - count_i`, ties to the
    first task), so every window of draws follows the weights as closely as integers allow. Which prompt: each
    task walks a permutation of its prompts drawn from (seed, task name, epoch), reshuffled every epoch.
    `state_dict()` after k draws + `load_state_dict` on a fresh mixture continues with draw k + 1 exactly.
    """

    def __init__(self, tasks: Sequence[Task], seed: int = 0) -> None:
        names = [t.name for t in tasks]
        if not tasks or len(set(names)) != len(names):
            raise ValueError(f"TaskMixture needs at least one task and unique names, got {names}")
        total = sum(t.weight for t in tasks)
        if any(t.weight < 0 or not math.isfinite(t.weight) for t in tasks) or total <= 0:
            raise ValueError(f"task weights must be finite, >= 0 and sum to > 0, got "
                             f"{ {t.name: t.weight for t in tasks} }")
        self.tasks = list(tasks)
        self.seed = seed
        self.shares = np.array([t.weight / total for t in tasks])
        self.num_drawn = 0
        self.counts = [0] * len(tasks)  # prompts drawn per task
        self._perms: dict[int, tuple[int, np.ndarray]] = {}  # task -> (epoch, permutation)
        self.last_draw: tuple[str, int] | None = None  # (task name, its draw number) of the latest prompt

    def _permutation(self, i: int, epoch: int) -> np.ndarray:
        cached = self._perms.get(i)
        if cached is None or cached[0] != epoch:
            name = self.tasks[i].name
            rng = np.random.default_rng([self.seed & 0xFFFFFFFFFFFFFFFF, zlib.crc32(name.encode()), epoch])
            cached = (epoch, rng.permutation(len(self.tasks[i].train)))
            self._perms[i] = cached
        return cached[1]

    def __iter__(self) -> TaskMixture:
        return self

    def __next__(self) -> Prompt:
        deficits = self.shares * (self.num_drawn + 1) - np.array(self.counts)
        deficits[self.shares == 0] = -np.inf
        i = int(np.argmax(deficits))
        prompt = self._draw(i, self.counts[i])
        self.last_draw = (self.tasks[i].name, self.counts[i])
        self.counts[i] += 1
        self.num_drawn += 1
        return prompt

    def _draw(self, i: int, count: int) -> Prompt:
        epoch, offset = divmod(count, len(self.tasks[i].train))
        return self.tasks[i].train[int(self._permutation(i, epoch)[offset])]

    def replay(self, task: str, count: int) -> Prompt:
        """The prompt of `task`'s draw number `count` (from 0, as in `last_draw`); the stream does not move."""
        names = [t.name for t in self.tasks]
        if task not in names:
            raise ValueError(f"TaskMixture has no task {task!r} (tasks: {names})")
        return self._draw(names.index(task), count)

    def take(self, n: int) -> list[Prompt]:
        """The next `n` prompts."""
        return [next(self) for _ in range(n)]

    def state_dict(self) -> dict[str, Any]:
        """JSON-able position in the stream."""
        return {"seed": self.seed, "num_drawn": self.num_drawn,
                "tasks": [{"name": t.name, "size": len(t.train), "count": c} for t, c in zip(self.tasks, self.counts)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; the tasks (names, sizes) and seed must match the ones it was saved with (UserError
        naming data.tasks or data.seed: a resumed run whose recipe changed them)."""
        saved = [(t["name"], t["size"]) for t in state["tasks"]]
        current = [(t.name, len(t.train)) for t in self.tasks]
        if saved != current:
            raise UserError(f"data.tasks: the checkpoint's prompt stream was drawn from tasks (name, train prompts) "
                            f"{saved}, but the recipe's are {current}: resume with the same data.tasks")
        if state["seed"] != self.seed:
            raise UserError(f"data.seed: the checkpoint's prompt stream was drawn with seed {state['seed']}, but the "
                            f"recipe's is {self.seed}: resume with the same data.seed")
        self.num_drawn = int(state["num_drawn"])
        self.counts = [int(t["count"]) for t in state["tasks"]]

    def __repr__(self) -> str:
        mix = ", ".join(f"{t.name}×{s:.2f}" for t, s in zip(self.tasks, self.shares))
        return f"TaskMixture({mix}; drawn {self.num_drawn})"
