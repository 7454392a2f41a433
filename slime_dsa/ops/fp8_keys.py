"""Indexer keys held in FP8 (e4m3) with one float32 scale per key row, as DeepSeek's and SGLang's DSA indexers cache them.

An engine's index-key cache in FP8 halves the bytes its decode indexer reads, and that scoring is bound by them
(benchmarks/RESULTS.md, issue 20). A row is stored as values * scale with scale = amax(|row|) / 448 (e4m3's largest
finite value). Scores apply the scale after the head sum, exactly: relu(a * s) = s * relu(a) for s > 0, so
score[n] = scale[n] * sum_j w_j relu(q_j . values[n] * softmax_scale). Every e4m3 value is an fp16 (and bf16) value,
so kernels read one byte a key element and convert it exactly (the Triton kernels to fp16, with the queries:
`triton_indexer_paged.fp16_queries`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
_MIN_AMAX = 1e-12  # an all-zero row gets this amax: its values stay 0


@dataclass(frozen=True)
class Fp8Keys:
    """Key rows (..., Di) float8_e4m3fn and their scales (...) float32: row n is values[n] * scales[n]."""

    values: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        if self.values.dtype != FP8_DTYPE or self.scales.dtype != torch.float32:
            raise ValueError(f"Fp8Keys needs float8_e4m3fn values and float32 scales, got {self.values.dtype} and "
                             f"{self.scales.dtype}")
        if self.values.shape[:-1] != self.scales.shape:
            raise ValueError(f"Fp8Keys: scales {tuple(self.scales.shape)} do not match values "
                             f"{tuple(self.values.shape)} without their last dimension")

    def detach(self) -> Fp8Keys:
        """Itself: cached keys carry no autograd graph (the model detaches whatever indexer keys it gets)."""
        return self

    def rows(self, index: torch.Tensor | slice) -> Fp8Keys:
        """The rows at `index` (a tensor of any shape, or a slice) of a (rows, Di) store."""
        values = self.values.view(torch.uint8)[index].view(FP8_DTYPE)  # fp8 lacks some indexing kernels: bytes
        return Fp8Keys(values, self.scales[index])

    def dequantize(self) -> torch.Tensor:
        """The rows in float32."""
        return self.values.float() * self.scales[..., None]


def quantize_keys(keys: torch.Tensor) -> Fp8Keys:
    """Each row of keys (..., Di) to FP8 with its own scale amax(|row|) / 448."""
    keys32 = keys.float()
    scales = keys32.abs().amax(-1).clamp_min(_MIN_AMAX) / E4M3_MAX
    values = (keys32 / scales[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return Fp8Keys(values, scales)


def split_keys(keys: torch.Tensor | Fp8Keys) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(values, per-row scales or None) of plain or FP8 keys."""
    return (keys.values, keys.scales) if isinstance(keys, Fp8Keys) else (keys, None)


__all__ = ["E4M3_MAX", "FP8_DTYPE", "Fp8Keys", "quantize_keys", "split_keys"]
