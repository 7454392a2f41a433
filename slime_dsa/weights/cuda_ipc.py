"""Weights shared by CUDA IPC, described in JSON: one flat GPU buffer, a handle to it and a name/shape/dtype table.

The sender (trainer rank 0) packs every tensor into one uint8 buffer on its GPU and exports a CUDA IPC handle for
it once; a receiver on the same GPU (an embedded engine) opens the handle, copies each slice into its parameters
and keeps the buffer mapped while the handle stays the same. torch's own format for this is a pickle
(torch.multiprocessing); here every rebuild argument is an explicit JSON field, checked before torch's rebuild
function sees it, so no request can run code.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from slime_dsa.weights import WeightFormatError

LOAD_FORMAT_CUDA_IPC = "cuda_ipc"
ALIGN_BYTES = 256  # every slice starts on a 256-byte boundary: any dtype's view is aligned, copies vectorise
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8, "bool": torch.bool,
}
# torch names its IPC ref-counter files /torch_<pid>_<random>_<counter> (at::NewProcessWideShmHandle); the
# receiver opens that shared-memory file and decrements one int64 in it, so both are checked.
_REF_COUNTER_NAME = re.compile(rb"/torch_\d+_\d+_\d+")
REF_COUNTER_SLOTS = 10000  # CUDA_IPC_REF_COUNTER_FILE_SIZE in torch/csrc/CudaIPCTypes.h
_MAX_HANDLE_BYTES = 1024


class IpcFormatError(WeightFormatError):
    """A cuda_ipc weights entry is malformed; the message names the field or tensor."""


@dataclass(frozen=True)
class IpcTensor:
    """One tensor of the buffer: `shape` and `dtype` at byte `offset`."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype].itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class IpcBuffer:
    """torch's CUDA IPC rebuild arguments of a flat uint8 buffer of `nbytes`, on the GPU `device_uuid`."""

    device_uuid: str
    handle: bytes  # the allocation's IPC handle (cudaIpcMemHandle, as torch's storage._share_cuda_ gives it)
    storage_size_bytes: int  # the storage's size; the buffer is its first nbytes
    storage_offset_bytes: int  # where the storage starts in the CUDA allocation the handle names
    nbytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


@dataclass(frozen=True)
class IpcWeights:
    """A buffer and its table: the value of one serialized_named_tensors entry with load_format cuda_ipc."""

    buffer: IpcBuffer
    tensors: tuple[IpcTensor, ...]

    def to_json(self) -> dict[str, Any]:
        b = self.buffer
        return {
            "buffer": {
                "device_uuid": b.device_uuid, "handle": _b64(b.handle), "storage_size_bytes": b.storage_size_bytes,
                "storage_offset_bytes": b.storage_offset_bytes, "nbytes": b.nbytes,
                "ref_counter_handle": _b64(b.ref_counter_handle), "ref_counter_offset": b.ref_counter_offset,
                "event_handle": None if b.event_handle is None else _b64(b.event_handle),
                "event_sync_required": b.event_sync_required,
            },
            "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "offset": t.offset}
                        for t in self.tensors],
        }

    @classmethod
    def from_json(cls, obj: Any, where: str = "serialized_named_tensors[0]") -> IpcWeights:
        """Parse and check an entry: types, handle formats, every tensor inside the buffer. IpcFormatError names the field."""
        if not isinstance(obj, dict):
            raise IpcFormatError(f"{where} must be a JSON object with buffer and tensors, got {type(obj).__name__}")
        raw, entries = obj.get("buffer"), obj.get("tensors")
        if not isinstance(raw, dict):
            raise IpcFormatError(f"{where}.buffer must be an object, got {type(raw).__name__}")
        if not isinstance(entries, list) or not entries:
            raise IpcFormatError(f"{where}.tensors must be a non-empty list")
        at = f"{where}.buffer"
        uuid = raw.get("device_uuid")
        if not isinstance(uuid, str) or not 0 < len(uuid) <= 128:
            raise IpcFormatError(f"{at}.device_uuid must be a non-empty string, got {uuid!r}")
        size = _int(raw, "storage_size_bytes", at, minimum=1)
        start = _int(raw, "storage_offset_bytes", at, minimum=0)
        nbytes = _int(raw, "nbytes", at, minimum=1)
        if nbytes > size:  # the view starts at the storage's first byte
            raise IpcFormatError(f"{at}.nbytes ({nbytes}) exceeds storage_size_bytes ({size})")
        ref_handle = _bytes(raw, "ref_counter_handle", at)
        if not _REF_COUNTER_NAME.fullmatch(ref_handle):
            raise IpcFormatError(f"{at}.ref_counter_handle must name a torch ref-counter file (/torch_<pid>_<n>_<n>)")
        ref_offset = _int(raw, "ref_counter_offset", at, minimum=0)
        if ref_offset >= REF_COUNTER_SLOTS:
            raise IpcFormatError(f"{at}.ref_counter_offset ({ref_offset}) must be below {REF_COUNTER_SLOTS}")
        sync = raw.get("event_sync_required")
        if not isinstance(sync, bool):
            raise IpcFormatError(f"{at}.event_sync_required must be true or false, got {sync!r}")
        event = None if raw.get("event_handle") is None else _bytes(raw, "event_handle", at)
        if sync and event is None:
            raise IpcFormatError(f"{at}.event_handle is required when event_sync_required is true")
        buffer = IpcBuffer(uuid, _bytes(raw, "handle", at), size, start, nbytes, ref_handle, ref_offset, event, sync)
        tensors = tuple(_tensor(e, f"{where}.tensors[{i}]", nbytes) for i, e in enumerate(entries))
        seen: set[str] = set()
        for i, t in enumerate(tensors):
            if t.name in seen:
                raise IpcFormatError(f"{where}.tensors[{i}]: tensor {t.name} appears twice")
            seen.add(t.name)
        return cls(buffer, tensors)

    def check_against(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """IpcFormatError unless every tensor is one of the model's (`shapes`: name -> shape) with its shape."""
        for t in self.tensors:
            if t.name not in shapes:
                raise IpcFormatError(f"tensor {t.name}: the model has no tensor of that name")
            if t.shape != tuple(shapes[t.name]):
                raise IpcFormatError(f"tensor {t.name} has shape {t.shape}, the model expects {tuple(shapes[t.name])}")


def layout(specs: Iterable[tuple[str, tuple[int, ...], str]]) -> tuple[tuple[IpcTensor, ...], int]:
    """(the table, the buffer's size in bytes) for (name, shape, dtype name) triples, each slice aligned."""
    tensors, offset = [], 0
    for name, shape, dtype in specs:
        t = IpcTensor(name, tuple(int(d) for d in shape), dtype, offset)
        tensors.append(t)
        offset += -(-t.nbytes // ALIGN_BYTES) * ALIGN_BYTES
    return tuple(tensors), max(offset, 1)


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise IpcFormatError(f"dtype {name} cannot be shared by cuda_ipc (one of {sorted(DTYPES)})")
    return name


def device_uuid(device: torch.device | None = None) -> str:
    """The UUID of a CUDA device: the same GPU has the same UUID in every process, whatever its index there."""
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def export_buffer(flat: torch.Tensor) -> IpcBuffer:
    """The IPC rebuild arguments of `flat` (a 1-D uint8 CUDA tensor that owns its storage from offset 0).

    Call once per buffer: each export adds a ref-counter slot. The sender keeps `flat` alive while receivers use it.
    """
    from torch.multiprocessing.reductions import reduce_tensor  # noqa: PLC0415

    if flat.dtype != torch.uint8 or flat.dim() != 1 or not flat.is_cuda or flat.storage_offset() != 0:
        raise ValueError("export_buffer needs a 1-D uint8 CUDA tensor at offset 0 of its storage")
    _, args = reduce_tensor(flat)
    (_, _, _, _, _, _, _, handle, size, start, _, ref_handle, ref_offset, event, sync) = args
    return IpcBuffer(device_uuid(flat.device), bytes(handle), int(size), int(start), flat.numel(), bytes(ref_handle),
                     int(ref_offset), None if event is None else bytes(event), bool(sync))


def open_buffer(buffer: IpcBuffer, device: torch.device) -> torch.Tensor:
    """A uint8 view of the sender's buffer on `device` (which must be the GPU buffer.device_uuid names)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor  # noqa: PLC0415

    if device.type != "cuda":
        raise IpcFormatError(f"load_format {LOAD_FORMAT_CUDA_IPC!r} needs an engine on a CUDA device; this one runs on {device}")
    here = device_uuid(device)
    if buffer.device_uuid != here:
        raise IpcFormatError(f"buffer.device_uuid {buffer.device_uuid} is not this engine's GPU ({here}): "
                             "cuda_ipc works only between processes on the same GPU")
    index = device.index if device.index is not None else torch.cuda.current_device()
    # Fixed classes and a checked dtype: nothing from the request chooses what gets constructed.
    return rebuild_cuda_tensor(
        torch.Tensor, (buffer.nbytes,), (1,), 0, torch.UntypedStorage, torch.uint8, index, buffer.handle,
        buffer.storage_size_bytes, buffer.storage_offset_bytes, False, buffer.ref_counter_handle,
        buffer.ref_counter_offset, buffer.event_handle, buffer.event_sync_required,
    )


def views(flat: torch.Tensor, tensors: Iterable[IpcTensor]) -> dict[str, torch.Tensor]:
    """name -> a view of its slice of `flat` with its dtype and shape (no copy)."""
    return {t.name: flat[t.offset : t.offset + t.nbytes].view(DTYPES[t.dtype]).view(t.shape) for t in tensors}


def float_spans(flat: torch.Tensor, tensors: Iterable[IpcTensor]) -> list[torch.Tensor]:
    """1-D views of `flat` that together hold every floating-point tensor of the table: each run of neighbouring
    slices of one dtype is one view, the padding between them included (every offset is a multiple of its dtype's
    size, so every slice's elements fall on the run's). A finiteness check then takes one tensor per run."""
    runs: list[list] = []  # [dtype, start, end]
    for t in sorted(tensors, key=lambda t: t.offset):
        dtype = DTYPES[t.dtype]
        if not dtype.is_floating_point or t.nbytes == 0:
            runs.append([None, 0, 0])  # breaks a run
        elif runs and runs[-1][0] == dtype:
            runs[-1][2] = max(runs[-1][2], t.offset + t.nbytes)  # a table's slices may overlap
        else:
            runs.append([dtype, t.offset, t.offset + t.nbytes])
    return [flat[start:end].view(dtype) for dtype, start, end in runs if dtype is not None]


def _tensor(entry: Any, where: str, buffer_bytes: int) -> IpcTensor:
    if not isinstance(entry, dict):
        raise IpcFormatError(f"{where} must be an object with name, shape, dtype and offset")
    name, shape, dtype = entry.get("name"), entry.get("shape"), entry.get("dtype")
    if not isinstance(name, str) or not name:
        raise IpcFormatError(f"{where}.name must be a non-empty string, got {name!r}")
    where = f"{where} ({name})"
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise IpcFormatError(f"{where}.shape must be a list of non-negative integers, got {shape!r}")
    if dtype not in DTYPES:
        raise IpcFormatError(f"{where}.dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    offset = _int(entry, "offset", where, minimum=0)
    t = IpcTensor(name, tuple(shape), dtype, offset)
    if offset % DTYPES[dtype].itemsize:
        raise IpcFormatError(f"{where}.offset ({offset}) is not a multiple of the {dtype} item size")
    if offset + t.nbytes > buffer_bytes:
        raise IpcFormatError(f"{where}: offset + bytes ({offset} + {t.nbytes}) exceeds the buffer's {buffer_bytes} bytes")
    return t


def _int(obj: dict, key: str, where: str, minimum: int) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise IpcFormatError(f"{where}.{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _bytes(obj: dict, key: str, where: str) -> bytes:
    value = obj.get(key)
    if not isinstance(value, str):
        raise IpcFormatError(f"{where}.{key} must be a base64 string, got {type(value).__name__}")
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise IpcFormatError(f"{where}.{key} is not valid base64") from None
    if not 0 < len(data) <= _MAX_HANDLE_BYTES:
        raise IpcFormatError(f"{where}.{key} must decode to 1..{_MAX_HANDLE_BYTES} bytes, got {len(data)}")
    return data


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
