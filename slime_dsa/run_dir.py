"""A run's directory and what the run starts from: the one setup that train, sft and indexer-warmup share.

    with open_run_dir(recipe, "train.log") as run_dir:   # runs/<name>/, recipe.yaml, the log file
        model_dir = prepare_model_dir(recipe, run_dir)    # model.path, or a from-scratch preset saved there
        tokenizer = load_tokenizer(recipe, model_dir)

The directory is held for the length of the `with` block: open_run_dir takes its lock (slime_dsa/run_lock.py), so a
second run in the same directory fails at once; `held_lock(run_dir)` is that lock, for what only its holder may do
(removing the temporary directories of killed checkpoint saves).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from slime_dsa.config import RecipeConfig, dump_recipe
from slime_dsa.config.errors import UserError
from slime_dsa.durable import make_temp_dir, publish, write_atomic, write_failure
from slime_dsa.run_lock import OutputLock, RunLock

logger = logging.getLogger(__name__)
_HELD: dict[Path, RunLock] = {}  # run directory (resolved) -> the lock this process holds on it

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def refuse_an_earlier_runs_metrics(recipe: RecipeConfig, command: str) -> None:
    """For the commands without --resume (sft, indexer-warmup): a second run in a run directory would append its steps
    to the earlier run's metrics.jsonl (and W&B run), two step 1s in one file, as `train` refuses to mix runs."""
    metrics = resolve_run_dir(recipe) / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        raise UserError(f"{metrics} holds an earlier run's metrics: {command} cannot continue a run; give this one "
                        "another logging.run_dir, or remove that run directory to start over")


def with_absolute_paths(recipe: RecipeConfig) -> RecipeConfig:
    """A copy of `recipe` whose relative local paths (model, tokenizer, run and checkpoint directories, critic and
    teachers) are absolute: Ray actors resolve paths against their own working directory, which on a cluster joined
    with cluster.address is where `ray start` ran, not the driver's."""
    out = recipe.model_copy(deep=True)

    def absolute(value: str | None, must_exist: bool = True) -> str | None:
        if value is None or Path(value).is_absolute() or (must_exist and not Path(value).exists()):
            return value  # a missing path keeps its own error; a tokenizer_path may be a Hub id
        return str(Path(value).absolute())

    out.model.path, out.model.tokenizer_path = absolute(out.model.path), absolute(out.model.tokenizer_path)
    out.logging.run_dir = str(resolve_run_dir(out).absolute())
    out.checkpoint.dir = absolute(out.checkpoint.dir, must_exist=False)
    out.critic.path = absolute(out.critic.path)
    for teacher in out.teachers:
        teacher.path = absolute(teacher.path)
    return out


def resolve_run_dir(recipe: RecipeConfig) -> Path:
    """logging.run_dir, or runs/<run_name>, or runs/<timestamp>."""
    log = recipe.logging
    if log.run_dir:
        return Path(log.run_dir)
    return Path("runs") / (log.run_name or time.strftime("run-%Y%m%d-%H%M%S"))


def write_resolved_recipe(recipe: RecipeConfig, run_dir: Path) -> None:
    """run_dir/recipe.yaml: the recipe with every default and --set applied, as the run saw it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "recipe.yaml", dump_recipe(recipe))


OUTPUT_DIRS = {"sft.output_dir": "sft_model", "indexer_warmup.output_dir": "dsa_model"}  # key -> default in the run


def output_dir(recipe: RecipeConfig, run_dir: Path, key: str) -> Path:
    """Where a job writes its model: the recipe's `key` (sft.output_dir, indexer_warmup.output_dir), else its default
    name in run_dir (OUTPUT_DIRS)."""
    section, field = key.split(".")
    value = getattr(getattr(recipe, section), field)
    return Path(value) if value else run_dir / OUTPUT_DIRS[key]


@contextmanager
def open_run_dir(recipe: RecipeConfig, log_name: str, output_key: str | None = None) -> Iterator[Path]:
    """The run directory, locked for this run, with recipe.yaml written and this process's log copied to
    run_dir/log_name until the block ends. UserError (one line, the holder's pid) when another run holds it.

    `output_key` (sft.output_dir, indexer_warmup.output_dir): the directory the job will write its model to
    (output_dir) is locked too, from here until the block ends (run_lock.OutputLock, as export and the convert tools
    take it), and what killed writers left beside it is removed. Inside the run directory (the default) as well: the
    run's lock does not stop another run, an export or a conversion whose output names it."""
    run_dir = resolve_run_dir(recipe)
    with RunLock(run_dir) as lock, ExitStack() as held:
        _HELD[run_dir.resolve()] = lock
        try:
            output = None
            if output_key is not None:  # before anything is written: a refused run leaves no recipe.yaml or log
                output = OutputLock(output_dir(recipe, run_dir, output_key), output_key)
                output.acquire(clean_up=False)
                held.callback(output.release)
            write_resolved_recipe(recipe, run_dir)
            with log_to_file(run_dir / log_name):
                lock.log_takeover()
                if output is not None:
                    output.clean_up()  # its one line in the run's log
                yield run_dir
        finally:
            _HELD.pop(run_dir.resolve(), None)


@contextmanager
def locked_checkpoint_dir(directory: Path) -> Iterator[RunLock]:
    """checkpoint.dir locked for this run until the block ends (held_lock finds it): a run whose checkpoint.dir is
    another's, running, is refused in one line naming the holder's pid, as for a run directory."""
    with RunLock(directory, key="checkpoint.dir") as lock:
        _HELD[Path(directory).resolve()] = lock
        try:
            yield lock
        finally:
            _HELD.pop(Path(directory).resolve(), None)


def held_lock(run_dir: Path) -> RunLock | None:
    """The lock this process holds on `run_dir` (inside open_run_dir), else None."""
    return _HELD.get(Path(run_dir).resolve())


@contextmanager
def log_to_file(path: Path) -> Iterator[None]:
    """Root-logger records of INFO and above also go to `path` until the block ends."""
    root = logging.getLogger()
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    level = root.level
    root.addHandler(handler)
    if level > logging.INFO:
        root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()
        root.setLevel(level)


def _remove_unfinished_copies(run_dir: Path) -> None:
    """Delete the model-sized temporary directories an earlier start left when killed while writing initial_model (the
    run directory's lock is held: no other start is writing one)."""
    for leftover in sorted(run_dir.glob(".initial_model.tmp-*")):
        shutil.rmtree(leftover, ignore_errors=True)
        logger.info("removed %s, left by a start that did not finish writing initial_model", leftover)


class _CopyFailed(Exception):
    """A file copy's OSError, raised past shutil.copytree, which would collect it and copy the rest of the model."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _copy_file(source: str, target: str) -> None:
    try:
        shutil.copy2(source, target)
    except OSError as e:  # the first failed file ends the copy (a full disk fails every later one too)
        raise _CopyFailed(e) from e


def _with_index_topk(path: Path, index_topk: int, run_dir: Path) -> Path:
    """A copy of the model at `path` in run_dir/initial_model whose config.json says index_topk (the weights are the
    same: the budget only says how many keys the indexer selects). A failed write (a full disk) is one UserError,
    nothing of the copy left."""
    target = run_dir / "initial_model"
    if not (target / "config.json").exists():
        try:
            _copy_with_index_topk(path, index_topk, run_dir, target)
        except (OSError, _CopyFailed) as e:
            if (failure := write_failure(target, e.error if isinstance(e, _CopyFailed) else e)) is None:
                raise
            raise UserError(f"the copy of model.path with model.index_topk {index_topk} in the run directory, "
                            f"{target}: {failure}; nothing of it is left") from None
        logger.info("copied %s to %s with index_topk %d", path, target, index_topk)
    return _set_index_topk(target, index_topk)


def _copy_with_index_topk(path: Path, index_topk: int, run_dir: Path, target: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(run_dir / "initial_model")
    try:  # copied whole or not at all: a later start reuses whatever holds a config.json
        shutil.copytree(path, tmp, dirs_exist_ok=True, copy_function=_copy_file)
        config = json.loads((path / "config.json").read_text())
        (tmp / "config.json").write_text(json.dumps({**config, "index_topk": index_topk}, indent=2) + "\n")
        shutil.rmtree(target, ignore_errors=True)  # an earlier copy's leftovers, without a config.json
        publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _set_index_topk(model_dir: Path, index_topk: int | None) -> Path:
    """model_dir, its config.json's index_topk set to `index_topk` (None: as it is). A resumed run reuses the
    initial_model its first start wrote, whose budget a changed model.index_topk must still set. A failed write (a
    full disk) is one UserError, the old config.json kept."""
    config = json.loads((model_dir / "config.json").read_text())
    if index_topk is not None and config.get("index_topk") != index_topk:
        try:  # atomic: a failed write (a full disk) leaves the old config.json whole
            write_atomic(model_dir / "config.json", json.dumps({**config, "index_topk": index_topk}, indent=2) + "\n")
        except OSError as e:
            if (failure := write_failure(model_dir, e)) is None:
                raise
            raise UserError(f"{model_dir / 'config.json'}, rewritten for model.index_topk {index_topk}: {failure}; "
                            f"it still says index_topk {config.get('index_topk')}") from None
        logger.info("%s: index_topk %s -> %d (model.index_topk)", model_dir, config.get("index_topk"), index_topk)
    return model_dir


def check_model_dir(path: Path, key: str = "model.path", policy: bool = True) -> None:
    """UserError (one line naming `key`) for a model directory that the engines and trainer ranks would fail to load
    after Ray and they had started: no or unreadable weights, a config.json of another architecture, or (`policy`)
    a value model, which has no language-model head (model.path, a teacher's path; critic.path takes either)."""
    from slime_dsa.checkpoint.validate import model_dir_problem  # noqa: PLC0415
    from slime_dsa.config.paths import model_config_problem  # noqa: PLC0415
    from slime_dsa.models.config import ModelConfig  # noqa: PLC0415

    if problem := model_dir_problem(path) or model_config_problem(path, key, policy):  # the second: as recipe check
        raise UserError(f"{key}: {problem}")
    try:
        ModelConfig.from_pretrained(path)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{key}: {path / 'config.json'}: {e}") from None


def prepare_model_dir(recipe: RecipeConfig, run_dir: Path) -> Path:
    """The HF directory engines and trainers load: model.path (copied into the run when model.index_topk changes its
    budget), or a from-scratch preset saved into the run."""
    from slime_dsa.checkpoint import build_model  # noqa: PLC0415
    from slime_dsa.config.paths import config_eos_ids, no_eos_problem  # noqa: PLC0415
    from slime_dsa.data.tokenizer import build_tokenizer  # noqa: PLC0415
    from slime_dsa.models.presets import preset_config  # noqa: PLC0415

    _remove_unfinished_copies(run_dir)
    if recipe.model.path:
        path = Path(recipe.model.path)
        if not path.is_dir():
            raise FileNotFoundError(f"model.path {path} is not a directory")
        check_model_dir(path)
        if recipe.model.index_topk is None:
            return path
        load_tokenizer(recipe, path)  # a tokenizer too large, or of another EOS: refused before the model is copied
        return _with_index_topk(path, recipe.model.index_topk, run_dir)
    target = run_dir / "initial_model"
    # sized to the tokenizer the run uses (model.tokenizer_path, else the built-in): a larger one's ids ran past the
    # built-in's embedding rows (an IndexError at the first forward); highest id + 1, not len(), for ids with holes
    tokenizer = build_tokenizer() if (source := recipe.model.tokenizer_path) is None else _auto_tokenizer(source)
    if tokenizer.eos_token_id is None:  # sft ended each response with None (a TypeError at the first step), the
        raise UserError(no_eos_problem(source))  # engines stopped at no token, the agent loop's ChatFormat refused
    tokens = tokenizer_size(tokenizer)
    if (target / "config.json").exists():  # an earlier start of this run built it
        built = json.loads((target / "config.json").read_text())
        if tokens > (rows := built["vocab_size"]):
            raise UserError(f"model.tokenizer_path: its {tokens} tokens are more than the {rows} embedding "
                            f"rows of {target}, which an earlier start of this run built from scratch for another "
                            "tokenizer; use a new logging.run_dir")
        if tokenizer.eos_token_id not in (ids := config_eos_ids(built)):  # the engines would stop on the other's
            raise UserError(f"model.tokenizer_path: its eos_token {tokenizer.eos_token!r} (id "
                            f"{tokenizer.eos_token_id}) is not the eos_token_id {ids} of {target}, which an earlier "
                            "start of this run built from scratch for another tokenizer; use a new logging.run_dir")
        return _set_index_topk(target, recipe.model.index_topk)
    overrides = {} if recipe.model.index_topk is None else {"index_topk": recipe.model.index_topk}
    config = preset_config(recipe.model.scratch_preset, vocab_size=tokens, eos_token_id=tokenizer.eos_token_id,
                           **overrides)
    save_model(build_model(config, seed=recipe.trainer.seed), target, tokenizer.save_pretrained,
               f"the from-scratch model (model.preset) in the run directory, {target}")
    logger.info("built a %s model from scratch in %s", recipe.model.scratch_preset, target)
    return target


def load_tokenizer(recipe: RecipeConfig, model_dir: Path) -> Any:
    """The tokenizer at model.tokenizer_path, else the one saved with the model; UserError (one line naming the key)
    for model.path when the tokenizer has more tokens than the model has embedding rows (an id past them is an
    IndexError in the embedding), when config.json names no eos_token_id (read as 1, a stop for the engines), or when
    the tokenizer's eos_token is none of the model's (config.json's and generation_config.json's): another model's."""
    from slime_dsa.config.paths import (  # noqa: PLC0415
        config_eos_ids, eos_mismatch_problem, no_eos_id_problem, tokenizer_size_problem,
    )
    from slime_dsa.models.config import generation_eos_token_ids  # noqa: PLC0415

    source = recipe.model.tokenizer_path or str(model_dir)
    tokenizer = _auto_tokenizer(source)
    if recipe.model.path is not None:
        key = "model.tokenizer_path" if recipe.model.tokenizer_path else "model.path"
        config = json.loads((config_file := model_dir / "config.json").read_text())  # passed check_model_dir
        rows, tokens = config.get("vocab_size"), tokenizer_size(tokenizer)
        if isinstance(rows, int) and tokens > rows:
            raise UserError(f"{key}: {tokenizer_size_problem(source, tokens, model_dir, rows)}")
        if not (ids := config_eos_ids(config)):
            raise UserError(f"model.path: {no_eos_id_problem(config_file, source, tokenizer.eos_token_id is None)}")
        if tokenizer.eos_token_id not in (ids := list(dict.fromkeys(ids + generation_eos_token_ids(model_dir)))):
            problem = eos_mismatch_problem(config_file, ids, source, tokenizer.eos_token, tokenizer.eos_token_id)
            raise UserError(f"{key}: {problem}")
    return tokenizer


def tokenizer_size(tokenizer: Any) -> int:
    """The embedding rows `tokenizer` needs: its highest token id + 1, or its length where that is more. A tokenizer
    whose ids have holes (an id at or above its length) needs more rows than len(tokenizer), which sized too few."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)


def _auto_tokenizer(source: str) -> Any:
    """AutoTokenizer's tokenizer at `source` (a directory or a hub id), or one UserError saying it has none."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:
        logger.debug("AutoTokenizer.from_pretrained(%r) failed: %s", source, e)
        raise UserError(f"no tokenizer at {source}: transformers' AutoTokenizer cannot load one "
                        f"({type(e).__name__}); put the model's tokenizer files there or set "
                        "model.tokenizer_path") from None


def save_model(model: Any, directory: Path, extra: Callable[[Path], object], where: str, after: str = "") -> None:
    """save_pretrained of `model` into `directory`; a failed write (a full disk, unwritable) is one UserError,
    "{where}: {the failure}{after}", its temporary directory removed."""
    from slime_dsa.checkpoint import save_pretrained  # noqa: PLC0415 (torch)

    try:
        save_pretrained(model, directory, extra=extra)
    except Exception as e:
        if (failure := write_failure(directory, e)) is None:
            raise
        raise UserError(f"{where}: {failure}{after}") from None


def save_output_model(model: Any, out_dir: Path, key: str, extra: Callable[[Path], object], model_dir: Path) -> None:
    """save_model of the model a job made from `model_dir` into `out_dir`, set by `key` (sft.output_dir,
    indexer_warmup.output_dir), with model_dir's generation_config.json: the engines stop on its eos_token_id too."""

    def with_generation_config(tmp: Path) -> None:
        extra(tmp)
        if (source := model_dir / "generation_config.json").is_file():
            shutil.copy2(source, tmp / source.name)

    save_model(model, out_dir, with_generation_config, f"{key} {out_dir}", "; the trained model is not saved")
