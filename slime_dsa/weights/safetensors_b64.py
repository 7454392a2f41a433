"""Our safe encoding for POST /update_weights_from_tensor: safetensors bytes, base64, never a pickle.

SGLang's own format (load_format null | "direct" | "flattened_bucket") is base64 of a torch multiprocessing
pickle holding CUDA IPC handles. Unpickling HTTP input runs arbitrary code, so the embedded server refuses it;
trainers send `load_format: "safetensors_b64"` instead, built by `tensor_update_payloads`. Engines on the trainer's
GPU also take `load_format: "cuda_ipc"`: a JSON table of CUDA IPC rebuild arguments (slime_dsa.weights.cuda_ipc).
"""

from __future__ import annotations

import binascii
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import pybase64

from slime_dsa.weights import WeightFormatError

if TYPE_CHECKING:
    import torch

LOAD_FORMAT = "safetensors_b64"
SGLANG_PICKLE_FORMATS = (None, "direct", "flattened_bucket")
PICKLE_REFUSAL = (
    "serialized_named_tensors in SGLang's torch-multiprocessing pickle format (load_format {fmt!r}) is never "
    "unpickled by the embedded server (unpickling HTTP input can run arbitrary code); send load_format "
    f"{LOAD_FORMAT!r}: base64 of safetensors bytes (slime_dsa.weights.safetensors_b64.tensor_update_payloads "
    "builds it)"
)


def encode_named_tensors(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> str:
    """base64 of the safetensors serialization of `named_tensors` (moved to CPU)."""
    from safetensors.torch import save

    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    # clone: safetensors refuses tensors that share storage (tied embeddings, views of one flat buffer)
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in items}
    return pybase64.b64encode(save(tensors)).decode("ascii")


def decode_named_tensors(entry: Any, where: str = "serialized_named_tensors[0]") -> dict[str, torch.Tensor]:
    """Inverse of encode_named_tensors; WeightFormatError naming `where` for anything that is not safetensors."""
    from safetensors.torch import load

    if not isinstance(entry, str):
        raise WeightFormatError(f"{where} must be a base64 string, got {type(entry).__name__}")
    try:
        data = pybase64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError):
        raise WeightFormatError(f"{where} is not valid base64") from None
    if not _looks_like_safetensors(data) and data[:1] == b"\x80":  # pickle protocol 2+ opens with PROTO
        raise WeightFormatError(PICKLE_REFUSAL.format(fmt=LOAD_FORMAT) + f" ({where} holds a pickle)")
    try:
        return load(data)
    except Exception as e:  # safetensors raises its own SafetensorError for any malformed header
        raise WeightFormatError(f"{where} is not safetensors bytes: {e}") from None


def _looks_like_safetensors(data: bytes) -> bool:
    """safetensors opens with a little-endian u64 header length n, then n bytes of JSON starting with '{'.

    The first byte alone cannot tell it from a pickle: it is the header length's low byte, 0x80 in 1 of 32 files.
    """
    if len(data) < 9:
        return False
    n = int.from_bytes(data[:8], "little")
    return 8 + n <= len(data) and data[8:9] == b"{"


def tensor_update_payloads(
    named_tensors: Mapping[str, torch.Tensor],
    *,
    weight_version: str | None = None,
    flush_cache: bool = True,
    bucket_bytes: int = 512 * 1024**2,
) -> list[dict]:
    """POST /update_weights_from_tensor bodies for the embedded server, in buckets of about `bucket_bytes`.

    Only the last bucket flushes the cache and sets weight_version, so the version changes once, after all
    tensors are in.
    """
    from slime_dsa.checkpoint.hf_format import split_by_bytes

    buckets = split_by_bytes(named_tensors.items(), bucket_bytes)
    payloads = []
    for i, bucket in enumerate(buckets):
        last = i == len(buckets) - 1
        payloads.append({
            "serialized_named_tensors": [encode_named_tensors(bucket)],
            "load_format": LOAD_FORMAT,
            "flush_cache": flush_cache and last,
            "weight_version": weight_version if last else None,
        })
    return payloads
