"""Rotary position embedding of GLM-MoE-DSA: inverse frequencies (default, yarn) and the interleaved rotation."""

from __future__ import annotations

import math

import torch

from slime_dsa.models.config import ModelConfig
from slime_dsa.ops import invariant


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq (rope_dim/2,), attention_scaling), as transformers computes them for this config."""
    rope = config.rope_parameters
    dim, base = config.qk_rope_head_dim, rope.get("rope_theta", 10000.0)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim)
    if rope.get("rope_type", "default") == "default":
        return 1.0 / pos_freqs, 1.0
    return _yarn_inv_freq(rope, dim, base, pos_freqs, config.max_position_embeddings)


def _yarn_inv_freq(rope: dict, dim: int, base: float, pos_freqs: torch.Tensor, max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): blend interpolated and extrapolated frequencies by a linear ramp."""
    original_max = rope.get("original_max_position_embeddings", max_pos)
    factor = rope.get("factor") or max_pos / original_max
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.get("beta_fast") or 32), correction_dim(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, attention_factor


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotation tables for integer positions (T,): cos (T, 2, R/2) = [cos; cos] and sin (T, 2, R/2) = [-sin; sin].

    Built once per forward in the shape `apply_interleaved_rope` multiplies with, so each rotation is 4 kernels.
    """
    freqs = positions[:, None].float() * inv_freq.to(positions.device)  # (T, R/2)
    if invariant.is_enabled():  # each position's table whatever the batch (true on-policy)
        cos, sin = invariant.rowwise(torch.cos, freqs), invariant.rowwise(torch.sin, freqs)
    else:
        cos, sin = freqs.cos(), freqs.sin()
    cos, sin = (cos * scaling).to(dtype), (sin * scaling).to(dtype)
    return torch.stack([cos, cos], dim=1), torch.stack([-sin, sin], dim=1)


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... and lay the result out as [evens | odds].

    x (T, ..., R); cos/sin (T, 2, R/2) from `rope_cos_sin`. The output layout is transformers', so q·k
    products match it exactly: evens' = x_even cos - x_odd sin, odds' = x_odd cos + x_even sin.
    """
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + cos.shape[1:]
    pairs = x.unflatten(-1, (-1, 2)).transpose(-1, -2)  # (T, ..., 2, R/2): [evens; odds], a view
    return (pairs * cos.view(shape) + pairs.flip(-2) * sin.view(shape)).flatten(-2)
