"""Checkpoints: HF-format model directories (load/save)."""

from slime_dsa.checkpoint.hf_format import CheckpointError, build_model, load_model, read_state_dict, save_pretrained
from slime_dsa.checkpoint.value_format import load_value_model, save_value_model

__all__ = ["CheckpointError", "build_model", "load_model", "load_value_model", "read_state_dict", "save_pretrained",
           "save_value_model"]
