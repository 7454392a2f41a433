"""slime-dsa: RL post-training for DeepSeek-Sparse-Attention (GLM-5, glm_moe_dsa) language models.

Kept import-light so that the CLI answers fast: heavy modules load on first use.
"""

__version__ = "0.1.0"


def load_model(path_or_config, dtype=None, device=None):
    """A GlmMoeDsaForCausalLM from an HF directory (or a randomly initialised one from a config)."""
    from slime_dsa.checkpoint import load_model as _load  # noqa: PLC0415

    return _load(path_or_config, dtype=dtype, device=device)


__all__ = ["__version__", "load_model"]
