"""The files a recipe points at, and the packages its choices need, checked before anything slow starts (`recipe
check`, the start of train, sft and indexer-warmup).

The rule: model.path (and critic.path, each teachers.N.path) is a local directory holding config.json (train and
sft load no hub ids). The other paths (model.tokenizer_path, data.tasks.N.path) may name a hub id that the local
Hugging Face cache serves: a value that is on disk, or is shaped like a path (starts with '/', '.' or '~', has more
than one '/', or ends in a data file suffix), must exist; a value shaped like a hub id ('name' or 'org/name') that is
not on disk is left to the loader.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from slime_dsa.config.errors import raise_first_problem
from slime_dsa.config.schema import RecipeConfig
from slime_dsa.durable import creation_problem

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")  # what slime_dsa.data.prompts reads from a file
MODEL_TYPE = "glm_moe_dsa"  # the config.json model_type slime_dsa.models.config.ModelConfig reads
VALUE_ARCHITECTURE = "GlmMoeDsaForValue"  # slime_dsa.models.value_model's, named here without importing torch


def looks_like_hub_id(value: str) -> bool:
    """'name' or 'org/name', and no data file suffix."""
    return bool(_HUB_ID.match(value)) and not value.lower().endswith(DATA_SUFFIXES)


def check_recipe_paths(config: RecipeConfig, trainer_workers: bool = True) -> None:
    """Raise RecipeError naming the first key whose path is unusable (and how many more are); trainer_workers: also
    the library of trainer.backend (train's workers; sft trains in one process and refuses other backends)."""
    raise_first_problem(path_problems(config, trainer_workers))


def path_problems(config: RecipeConfig, trainer_workers: bool = True) -> list[tuple[str, str]]:
    """(key, what is wrong) for every path of the recipe that cannot be used."""
    problems = []
    if config.model.path is not None and (problem := _model_dir_problem(config.model.path, "model.path")):
        problems.append(("model.path", problem))
    elif config.model.path is not None and (problem := _parallel_problem(config)):
        problems.append((problem.split(" ", 1)[0], problem))  # the key the message names first
    if config.model.path is not None and not problems and (problem := _opd_topk_problem(config)):
        problems.append(("algorithm.opd_topk", problem))
    if config.model.path is not None and not problems and (problem := _eos_id_problem(config)):
        problems.append(("model.path", problem))
    if config.model.tokenizer_path is not None and (problem := _local_problem(config.model.tokenizer_path,
                                                                               dir_only=True)):
        problems.append(("model.tokenizer_path", problem))
    elif config.model.path is not None and not problems and (problem := _tokenizer_size_problem(config)):
        problems.append(("model.tokenizer_path" if config.model.tokenizer_path else "model.path", problem))
    elif config.model.path is None and config.model.tokenizer_path and _lacks_eos(config.model.tokenizer_path):
        problems.append(("model.tokenizer_path", no_eos_problem(config.model.tokenizer_path)))
    for i, task in enumerate(config.data.tasks):
        if task.kind == "dataset" and task.path and (problem := _local_problem(task.path)):
            problems.append((f"data.tasks.{i}.path", problem))
    if config.critic.path is not None and (problem := _model_dir_problem(config.critic.path, "critic.path", False)):
        problems.append(("critic.path", problem))
    for i, teacher in enumerate(config.teachers):
        # SGLang and external servers load their own architectures: only our engines' teachers are read
        ours = teacher.serving in ("embedded", "swap")
        if problem := _model_dir_problem(teacher.path, f"teachers.{i}.path" if ours else None):
            problems.append((f"teachers.{i}.path", problem))
    iw = config.indexer_warmup
    if iw.corpus == "dataset" and iw.dataset_path and (problem := _local_problem(iw.dataset_path)):
        problems.append(("indexer_warmup.dataset_path", problem))
    for key, value in (("logging.run_dir", config.logging.run_dir), ("checkpoint.dir", config.checkpoint.dir),
                       ("sft.output_dir", config.sft.output_dir),
                       ("indexer_warmup.output_dir", iw.output_dir)):  # directories a run writes into
        path = Path(value).expanduser() if value else None
        if path is not None and (blocker := next((p for p in (path, *path.parents) if p.is_file()), None)):
            problems.append((key, f"{blocker} is a file; {key} names a directory to write into"))
        elif path is not None and key.endswith("output_dir") and (problem := creation_problem(path)):
            problems.append((key, f"cannot create {value}: {problem}"))  # before the job runs, not after it trained
        elif path is not None and key.endswith("output_dir") and (problem := _holds_run_dir(path, config)):
            problems.append((key, problem))
    backend_library = _BACKEND_LIBRARIES.get(config.trainer.backend) if trainer_workers else None
    if backend_library is not None and not _installed(backend_library[0]):
        _, library, extra = backend_library
        problems.append(("trainer.backend", f"'{config.trainer.backend}' needs {library}, which is not installed here "
                                            f"({extra})"))
    return problems


def _holds_run_dir(output: Path, config: RecipeConfig) -> str | None:
    """Why a job's model cannot be published at `output`: it is the run directory or holds it, which the publish
    (a rename over `output`) would replace, logs and checkpoints included."""
    log = config.logging
    run_dir = Path(log.run_dir).expanduser() if log.run_dir else Path("runs") / log.run_name if log.run_name else None
    if run_dir is None:
        return None
    output, run_dir = output.resolve(), run_dir.resolve()
    if output == run_dir or output in run_dir.parents:
        return (f"{output} is {'the run directory' if output == run_dir else 'a directory holding the run directory'}"
                f" ({run_dir}), which publishing the model there would replace; name a directory inside it or beside "
                "it")
    return None


# A backend's library: (the module it imports, its name, how to install it).
_BACKEND_LIBRARIES = {"deepspeed": ("deepspeed", "DeepSpeed", "pip install -e '.[deepspeed]'"),
                      "megatron": ("megatron.core", "megatron-core",
                                   "pip install -e '.[megatron]', on Python 3.12 or later: its only wheels")}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is absent
        return False


def _model_dir_problem(value: str, key: str | None = None, policy: bool = True) -> str | None:
    """What keeps `value` from being a local model directory; with `key`, also what its config.json says against
    loading it there (model_config_problem)."""
    path = Path(value).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            return f"{value} holds no config.json (not a Hugging Face model directory)"
        return model_config_problem(path, key, policy) if key is not None else None
    if path.exists():
        return f"{value} is a file, not a model directory"
    if looks_like_hub_id(value):
        return (f"'{value}' is not a local directory; train and sft load a local model directory: download it first "
                f"(huggingface-cli download {value} --local-dir DIR) and set model.path to DIR")
    maker = _recipe_writing(path)
    return f"{value} does not exist" + (f" (`slime-dsa sft {maker}` writes it: run that first)" if maker else "")


def model_config_problem(directory: Path, key: str, policy: bool = True) -> str | None:
    """What `directory`'s config.json says that keeps it from loading as `key` (one line, after 'key: '): unreadable,
    another architecture than glm_moe_dsa, or (`policy`) a value model, which has no language-model head. Reads
    config.json only (no torch, no weights): `recipe check` and train's run_dir.check_model_dir share it."""
    import json  # noqa: PLC0415

    config = directory / "config.json"
    try:
        raw = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        return f"{config} is not readable JSON ({e})"
    if not isinstance(raw, dict):
        return f"{config} holds no JSON object"
    if raw.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        return f"{config}: config.json model_type is {raw['model_type']!r}, expected {MODEL_TYPE!r}"
    if policy and VALUE_ARCHITECTURE in (raw.get("architectures") or []):
        return (f"{directory} is a value model ({VALUE_ARCHITECTURE}, no language-model head); {key} takes a policy (a "
                "checkpoint's own directory or an export, not its critic/)")
    return None


def _recipe_writing(model_dir: Path) -> str | None:
    """The shipped recipe (recipes/*.yaml under the working directory) whose sft.output_dir is model_dir, if any: a
    recipe that trains from another stage's model names it in its error."""
    import yaml  # noqa: PLC0415

    for recipe in sorted(Path("recipes").glob("*.yaml")):
        try:
            output_dir = ((yaml.safe_load(recipe.read_text()) or {}).get("sft") or {}).get("output_dir")
        except (OSError, yaml.YAMLError, AttributeError):
            continue
        if output_dir and Path(output_dir).expanduser().resolve() == model_dir.resolve():
            return str(recipe)
    return None


def _parallel_problem(config: RecipeConfig) -> str | None:
    """Whether trainer.megatron's sizes divide the model at model.path (only for trainer.backend megatron)."""
    if config.trainer.backend != "megatron":
        return None
    from slime_dsa.models.config import ModelConfig  # noqa: PLC0415
    from slime_dsa.models.parallel_layout import ParallelSizes, check_parallel_sizes  # noqa: PLC0415

    try:
        check_parallel_sizes(ModelConfig.from_pretrained(Path(config.model.path).expanduser()),
                             ParallelSizes(**config.trainer.megatron.model_dump()), config.trainer.num_workers)
    except ValueError as err:
        return str(err)
    return None


def _opd_topk_problem(config: RecipeConfig) -> str | None:
    """Whether algorithm.opd_topk exceeds the vocabulary of the model at model.path (the teachers' engines refuse the
    top-k request at the first step, naming top_logprobs_num)."""
    if config.algorithm.name != "opd" or not config.algorithm.opd_topk:
        return None
    import json  # noqa: PLC0415

    try:
        vocab = json.loads((Path(config.model.path).expanduser() / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None  # the model's own checks name an unreadable config.json
    if isinstance(vocab, int) and config.algorithm.opd_topk > vocab:
        return (f"algorithm.opd_topk ({config.algorithm.opd_topk}) exceeds the vocabulary of model.path "
                f"({vocab} tokens)")
    return None


def tokenizer_size_problem(source: str, tokens: int, model_dir: str | Path, rows: int) -> str:
    """Why a tokenizer of `tokens` token ids cannot serve the model at `model_dir` of `rows` embedding rows (one line,
    after its key): recipe check reads the counts from the files, the run from the loaded tokenizer."""
    return (f"the tokenizer at {source} has {tokens} tokens, more than the {rows} embedding rows of the model at "
            f"{model_dir} (config.json vocab_size): a prompt or response holding a token id at or above {rows} would "
            "fail in the embedding (IndexError) mid-run; use the model's own tokenizer or one that fits it")


def tokenizer_file_size(directory: Path) -> int | None:
    """The token ids a tokenizer directory's tokenizer.json (and tokenizer_config.json's added tokens) define, highest
    id + 1, read without transformers; None without a readable tokenizer.json (a slow tokenizer's files, a hub id)."""
    import json  # noqa: PLC0415

    try:
        raw = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
        vocab = raw["model"]["vocab"]
        ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1]  # a Unigram's list: its index
        ids += [token["id"] for token in raw.get("added_tokens") or []]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        added = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        ids += [int(i) for i in added.get("added_tokens_decoder") or {}]
    except (OSError, ValueError, AttributeError, TypeError):
        pass  # no or an unreadable tokenizer_config.json: tokenizer.json's ids are the tokenizer's
    return max((i for i in ids if isinstance(i, int)), default=-1) + 1


def no_eos_problem(source: str) -> str:
    """The one line refusing a tokenizer without an eos_token for a model built from scratch."""
    return (f"model.tokenizer_path: the tokenizer at {source} has no eos_token; a model built from scratch "
            "(model.path null) takes its EOS from the tokenizer: generation stops on it and sft ends each response "
            "with it. Set eos_token in its tokenizer_config.json, or use a tokenizer that has one")


def config_eos_ids(raw: dict) -> list[int]:
    """The token ids a config.json's eos_token_id names (an int or a list of them): the ids the engines stop on."""
    value = raw.get("eos_token_id")
    values = value if isinstance(value, list) else [value]
    return [i for i in values if isinstance(i, int) and not isinstance(i, bool)]


def no_eos_id_problem(config_file: Path, source: str, tokenizer_lacks_eos: bool) -> str:
    """The one line (after 'model.path: ') refusing a model.path whose config.json names no EOS id."""
    either = ", which has none either: set one in its tokenizer_config.json too" if tokenizer_lacks_eos else ""
    return (f"{config_file} has no eos_token_id: the engines end a response on it (a missing one reads as token id "
            "1, transformers' default, whatever token that is; a null one as none), as SGLang does; set it to the id "
            f"of the eos_token of the tokenizer at {source}{either}")


def eos_mismatch_problem(config_file: Path, ids: list[int], source: str, token: str | None,
                         token_id: int | None) -> str:
    """The one line (after the tokenizer's key) refusing a tokenizer whose eos_token is not among the model's EOS ids
    (`ids`: config.json's and generation_config.json's eos_token_id): most likely another model's tokenizer."""
    said = ids[0] if len(ids) == 1 else ids
    if token_id is None:
        return (f"the tokenizer at {source} has no eos_token: sft ends each response with it (None) and the agent loop "
                f"stops on it; set eos_token in its tokenizer_config.json to the token of id {ids[0]}, the "
                f"eos_token_id of {config_file}")
    return (f"the eos_token of the tokenizer at {source}, {token!r} (id {token_id}), is not an eos_token_id of "
            f"{config_file} or its generation_config.json ({said}): a tokenizer of another model? sft would train "
            f"the model to end each response with {token_id}, not with the id it was made to end on; use the "
            f"model's own tokenizer, or add {token_id} to eos_token_id in config.json")


def _eos_id_problem(config: RecipeConfig) -> str | None:
    """Whether config.json of model.path names no EOS id (the run also checks the loaded tokenizer's eos_token)."""
    import json  # noqa: PLC0415

    config_file = Path(config.model.path).expanduser() / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None  # the model's own checks name an unreadable config.json
    if not isinstance(raw, dict) or config_eos_ids(raw):
        return None
    source = config.model.tokenizer_path or config.model.path
    return no_eos_id_problem(config_file, source, _lacks_eos(source))


# Tokenizer classes that give no eos_token of their own: only their files can name one.
_PLAIN_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _lacks_eos(value: str) -> bool:
    """Whether the local tokenizer directory `value` surely has no eos_token, read without transformers: its class
    gives none (_PLAIN_TOKENIZER_CLASSES) and neither tokenizer_config.json nor special_tokens_map.json names one.
    Another class may have a default (the run checks the loaded tokenizer); a hub id or unreadable file: False."""
    import json  # noqa: PLC0415

    directory = Path(value).expanduser()
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        special_map = directory / "special_tokens_map.json"
        special = json.loads(special_map.read_text(encoding="utf-8")) if special_map.is_file() else {}
        return (config.get("tokenizer_class") in _PLAIN_TOKENIZER_CLASSES and not config.get("eos_token")
                and not special.get("eos_token"))
    except (OSError, ValueError, AttributeError):
        return False


def _tokenizer_size_problem(config: RecipeConfig) -> str | None:
    """Whether the tokenizer of the run (model.tokenizer_path, else model.path's own) has more tokens than the model at
    model.path has embedding rows, as far as its tokenizer.json tells (the run checks the loaded tokenizer too)."""
    import json  # noqa: PLC0415

    model_dir = Path(config.model.path).expanduser()
    source = config.model.tokenizer_path or config.model.path
    try:
        rows = json.loads((model_dir / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None  # the model's own checks name an unreadable config.json
    tokens = tokenizer_file_size(Path(source).expanduser())
    if isinstance(rows, int) and tokens is not None and tokens > rows:
        return tokenizer_size_problem(source, tokens, config.model.path, rows)
    return None


def _local_problem(value: str, dir_only: bool = False) -> str | None:
    path = Path(value).expanduser()
    if path.is_dir():
        return None
    if path.exists():
        if dir_only:
            return f"{value} is a file, not a directory"
        suffix = path.suffix.lower()
        if suffix in DATA_SUFFIXES:
            return None
        return f"{value} is a {suffix or 'suffixless'} file; expected .jsonl, .json or .parquet"
    return None if looks_like_hub_id(value) else f"{value} does not exist"
