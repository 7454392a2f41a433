"""Value-model directories: config.json (architectures GlmMoeDsaForValue) plus safetensors named `model.*` (the
backbone, the policy's names) and `value_head.weight` / `value_head.bias`.

A value model starts from one of two directories: a value model (everything loaded), or a policy (its backbone,
with a fresh head: the SAO paper's initialisation). The tensor names tell which.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from slime_dsa.checkpoint.hf_format import _parse_dtype, check_and_assign, read_state_dict, save_pretrained, saved_dtype
from slime_dsa.models.config import ModelConfig
from slime_dsa.models.value_model import VALUE_HEAD, GlmMoeDsaForValue, fresh_value_head, value_config

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
    wanted = value_state_from(state, config)
    if is_value_state(state):
        wanted.update({k: v for k, v in state.items() if k.startswith(f"{VALUE_HEAD}.")})
    else:
        wanted.update(fresh_value_head(config, seed))
        logger.info("value model: the backbone of the policy in %s under a fresh value head", directory)
    target = _parse_dtype(dtype) or saved_dtype(state)
    with torch.device("meta"):
        model = GlmMoeDsaForValue(config)
    check_and_assign(model, wanted)
    model.cast(target)
    return model.to(device) if device is not None else model


def save_value_model(model: GlmMoeDsaForValue, directory: str | Path,
                     state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a value-model directory atomically (the state dict of `model` unless given)."""
    return save_pretrained(model, directory, state_dict=state_dict)
