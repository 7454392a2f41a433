"""Checkpoints: HF-format model directories (load/save)."""

from slime_dsa.checkpoint.hf_format import CheckpointError, build_model, load_model, read_state_dict, save_pretrained

__all__ = ["CheckpointError", "build_model", "load_model", "read_state_dict", "save_pretrained"]
