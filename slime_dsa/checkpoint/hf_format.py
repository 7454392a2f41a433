"""Read and write HF-format model directories: config.json plus safetensors (sharded with an index when large).

Tensor names are exactly transformers' GlmMoeDsaForCausalLM names, so no conversion is ever needed.
Loading reads safetensors only: nothing is ever unpickled.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from slime_dsa.durable import apply_umask, carry_over, make_temp_dir, publish_over, set_aside_copies
from slime_dsa.models.config import ModelConfig
from slime_dsa.models.glm_moe_dsa import GlmMoeDsaForCausalLM

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


class Progress(Protocol):
    """What long reads and writes report to (rollout/progress.SampleProgress): more work to do, work done."""

    def add_total(self, count: int) -> None: ...

    def advance(self, count: int) -> None: ...


class NoProgress:
    """A Progress that shows nothing (callers that pass none)."""

    def add_total(self, count: int) -> None:
        pass

    def advance(self, count: int) -> None:
        pass


class CheckpointError(ValueError):
    """A checkpoint does not fit the model: names the tensor and both shapes."""


def _parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(names)}")
    return names[dtype]


def build_model(config: ModelConfig, dtype: torch.dtype | str | None = None, device: torch.device | str | None = None, seed: int | None = None) -> GlmMoeDsaForCausalLM:
    """A randomly initialised model (initialised in float32 on the CPU for reproducibility, then moved)."""
    if seed is not None:
        torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(config)
    model.init_weights()
    model.cast(_parse_dtype(dtype) or torch.float32)
    return model.to(device) if device is not None else model


def _state_dict_for_save(model: GlmMoeDsaForCausalLM) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {name: t.detach().contiguous().cpu() for name, t in state.items()}


def save_pretrained(
    model: GlmMoeDsaForCausalLM,
    directory: str | Path,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    state_dict: dict[str, torch.Tensor] | None = None,
    extra: Callable[[Path], object] | None = None,
    progress: Progress | None = None,
) -> Path:
    """Write config.json and safetensors into `directory` atomically and durably (a temporary directory, fsynced, then
    a rename); `extra(tmp)` writes more files there first (a tokenizer), so they arrive with the weights. An existing
    `directory` is replaced whole (durable.publish_over), keeping the files we do not write (a README). `progress`
    (rollout/progress.SampleProgress) counts the weight files."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    state = state_dict if state_dict is not None else _state_dict_for_save(model)
    progress = progress or NoProgress()
    tmp = make_temp_dir(directory)
    try:
        model.config.save(tmp)
        shards = [dict(bucket) for bucket in split_by_bytes(state.items(), max_shard_bytes)]
        progress.add_total(len(shards))
        if len(shards) == 1:
            save_file(shards[0], tmp / WEIGHTS_NAME, metadata={"format": "pt"})
            progress.advance(1)
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, tmp / name, metadata={"format": "pt"})
                weight_map.update({key: name for key in shard})
                progress.advance(1)
            total = sum(t.numel() * t.element_size() for t in state.values())
            (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        if extra is not None:
            extra(tmp)
        apply_umask(tmp)  # before carry_over: the user's files keep their own modes
        if directory.exists():
            carry_over(directory, tmp, keep=lambda name: not is_weight_file(name))
        publish_over(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def is_weight_file(name: str) -> bool:
    """A file of an HF directory that a new write of its weights replaces (the others are kept)."""
    return name.endswith(".safetensors") or name == INDEX_NAME


def split_by_bytes(named_tensors, max_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive (name, tensor) pairs grouped into buckets of at most max_bytes (a larger tensor stands alone).

    One rule for checkpoint shards and for weight-sync buckets.
    """
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if buckets[-1] and size + nbytes > max_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, tensor))
        size += nbytes
    return buckets


def read_state_dict(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a directory's safetensors files (single or sharded)."""
    directory = Path(directory)
    index = directory / INDEX_NAME
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / WEIGHTS_NAME).exists():
        files = [WEIGHTS_NAME]
    else:
        pickles = [p.name for p in directory.glob("*.bin")] + [p.name for p in directory.glob("*.pt")]
        hint = f" (found {pickles}: pickled weights are never loaded; convert them to safetensors)" if pickles else ""
        raise FileNotFoundError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {directory}{hint}")
    state = {}
    for file in files:
        with safe_open(str(directory / file), framework="pt") as f:
            for key in f.keys():
                state[key] = f.get_tensor(key)
    return state


def saved_dtype(state: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype a checkpoint's weights are saved in: its embedding's (a bf16 checkpoint may hold its routers and
    indexer heads in float32)."""
    embedding = state.get("model.embed_tokens.weight")
    return embedding.dtype if embedding is not None else torch.float32


def check_and_assign(model: GlmMoeDsaForCausalLM, state: dict[str, torch.Tensor]) -> None:
    """Load `state` into `model`, failing with the tensor's name and both shapes on any mismatch."""
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        name = missing[0]
        raise CheckpointError(f"checkpoint is missing tensor {name} (model expects shape {tuple(expected[name].shape)}); {len(missing)} missing in all")
    if unexpected:
        name = unexpected[0]
        raise CheckpointError(f"checkpoint has unexpected tensor {name} (shape {tuple(state[name].shape)}); {len(unexpected)} unexpected in all")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"tensor {name} has shape {tuple(tensor.shape)} in the checkpoint, model expects {tuple(expected[name].shape)}")
    model.load_state_dict(state, strict=True, assign=True)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def _missing_model_dir(directory: Path) -> str:
    """One line: `directory` does not exist, and where its old contents are when an export into it was killed."""
    aside = set_aside_copies(directory)
    if not aside:
        return f"model directory {directory} does not exist"
    return (f"model directory {directory} does not exist: an export into it was interrupted; its previous contents "
            f"are whole in {aside[-1]}, rename that back to {directory.name}")


def load_model(
    path_or_config: str | Path | ModelConfig | dict,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
) -> GlmMoeDsaForCausalLM:
    """A model from an HF directory (weights loaded) or from a config (randomly initialised)."""
    if isinstance(path_or_config, (ModelConfig, dict)):
        config = path_or_config if isinstance(path_or_config, ModelConfig) else ModelConfig.from_dict(path_or_config)
        return build_model(config, dtype, device)
    directory = Path(path_or_config)
    if not directory.is_dir():
        raise FileNotFoundError(_missing_model_dir(directory))
    config = ModelConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(config)
    state = read_state_dict(directory)
    check_and_assign(model, state)
    model.cast(_parse_dtype(dtype) or saved_dtype(state))
    return model.to(device) if device is not None else model
