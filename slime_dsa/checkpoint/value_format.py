"""Value-model directories: config.json (architectures GlmMoeDsaForValue) plus safetensors named `model.*` (the
backbone, the policy's names) and `value_head.weight` / `value_head.bias`.

A value model starts from one of two directories: a value model (everything loaded), or a policy (its backbone,
with a fresh head: the SAO paper's initialisation). The tensor names tell which.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from slime_dsa.checkpoint.hf_format import CheckpointError, _parse_dtype, read_state_dict, save_pretrained
from slime_dsa.models.config import ModelConfig
from slime_dsa.models.value_model import VALUE_HEAD, GlmMoeDsaForValue, value_config

logger = logging.getLogger(__name__)


def is_value_state(state: dict[str, torch.Tensor]) -> bool:
    """Whether a state dict holds a value head (else it is a policy's)."""
    return f"{VALUE_HEAD}.weight" in state


def value_state_from(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The backbone tensors of a policy or value state dict that a value model of `config` holds."""
    n = config.num_hidden_layers
    keep = {}
    for name, tensor in state.items():
        if not name.startswith("model."):
            continue  # lm_head, value_head
        parts = name.split(".")
        if parts[1] == "layers" and int(parts[2]) >= n:
            continue  # MTP layers
        keep[name] = tensor
    return keep


def load_value_model(path: str | Path, dtype: torch.dtype | str | None = None,
                     device: torch.device | str | None = None, seed: int = 0) -> GlmMoeDsaForValue:
    """A value model from a value-model directory, or from a policy directory with a fresh head (seeded)."""
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"value model directory {directory} does not exist")
    config = value_config(ModelConfig.from_pretrained(directory))
    state = read_state_dict(directory)
    fresh_head = not is_value_state(state)
    wanted = value_state_from(state, config)
    if not fresh_head:
        wanted.update({k: v for k, v in state.items() if k.startswith(f"{VALUE_HEAD}.")})
    with torch.device("meta"):
        model = GlmMoeDsaForValue(config)
    expected = model.state_dict()
    if fresh_head:
        expected = {k: v for k, v in expected.items() if not k.startswith(f"{VALUE_HEAD}.")}
    missing = sorted(set(expected) - set(wanted))
    if missing:
        raise CheckpointError(f"{directory}: missing tensor {missing[0]} for the value model; {len(missing)} missing in all")
    for name, tensor in wanted.items():
        if name not in expected:
            raise CheckpointError(f"{directory}: unexpected tensor {name} for the value model")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{directory}: tensor {name} has shape {tuple(tensor.shape)}, the value model "
                                  f"expects {tuple(expected[name].shape)}")
    target = _parse_dtype(dtype) or next(iter(wanted.values())).dtype
    if fresh_head:
        model.value_head.to_empty(device="cpu")
        model.init_value_head(seed)
        wanted.update({k: v for k, v in model.value_head.state_dict(prefix=f"{VALUE_HEAD}.").items()})
        logger.info("value model: backbone from the policy in %s, a fresh value head", directory)
    model.load_state_dict(wanted, strict=True, assign=True)
    model.cast(target)
    return model.to(device) if device is not None else model


def save_value_model(model: GlmMoeDsaForValue, directory: str | Path,
                     state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a value-model directory atomically (the state dict of `model` unless given)."""
    return save_pretrained(model, directory, state_dict=state_dict)
