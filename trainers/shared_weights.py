"""Rank 0's weights in one GPU buffer that engines on the same GPU read by CUDA IPC (rollout.weight_sync cuda_ipc).

The buffer holds every tensor of the model's state dict, cast to the dtype the engine keeps it in (the model's
`cast` rule: bf16 engines keep the routers and indexer head weights in float32). It is exported once and refilled
for each weight version, so engines see the same handle every time.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch.distributed.tensor import DTensor

from slime_dsa.devices import foreach_copy
from slime_dsa.weights.cuda_ipc import IpcWeights, dtype_name, export_buffer, layout, views
from slime_dsa.weights.payloads import TensorSpec
from trainers.weight_sender import engine_dtypes, full_tensor


COPY_BUCKET_BYTES = 256 * 2**20


def _whole_here(t: torch.Tensor) -> bool:
    """Whether this rank holds all of `t` without a gather: a plain tensor, or a DTensor whose local shard is it."""
    return not isinstance(t, DTensor) or (t.device_mesh.size() == 1 and t.to_local().shape == t.shape)


class SharedWeights:
    """The flat buffer (on the sender, rank 0, only) and its table; `fill` copies the current weights in. Every rank
    builds one and calls fill: gathering a sharded tensor is a collective."""

    def __init__(self, model: torch.nn.Module, engine_dtype: str, sender: bool,
                 specs: list[TensorSpec] | None = None, device: torch.device | None = None) -> None:
        """specs and device: each tensor's name, engine dtype and whole shape, and the GPU, where the model's own
        tensors are partitions (which may live in host memory)."""
        if specs is None:
            targets = engine_dtypes(model.config, engine_dtype)
            specs = [TensorSpec(name, dtype_name(targets.get(name, t.dtype)), tuple(t.shape))
                     for name, t in model.state_dict().items()]
        self.tensors, nbytes = layout([(spec.name, tuple(spec.shape), spec.dtype) for spec in specs])
        self.flat: torch.Tensor | None = None
        self.weights: IpcWeights | None = None
        self._whole: tuple[torch.nn.Module, list[tuple[str, torch.Tensor]]] | None = None  # see _sources
        if sender:
            device = device or next(model.parameters()).device
            # Zeros: the padding between slices is never written, and a receiver's finiteness check reads it
            # (float_spans), where stale bytes could read as NaN
            self.flat = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            self._views = views(self.flat, self.tensors)
            self.weights = IpcWeights(export_buffer(self.flat), self.tensors)

    def fill(self, model: torch.nn.Module) -> dict | None:
        """Copy the model's current weights into the buffer (cast on the GPU); the sender returns the JSON table."""
        return self.fill_from(self._sources(model))

    def _sources(self, model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
        """(name, whole tensor) in state-dict order. Where every tensor is whole on this rank (plain tensors, or a
        one-rank mesh's shards), the first fill's list is kept: those are the live tensors the optimizer updates in
        place, and walking the state dict again cost each fill ~20 ms of host time at 795 tensors (CPU). A sharded
        model's are gathered anew each fill (a collective, in the same order on every rank)."""
        if self._whole is not None and self._whole[0] is model:
            return self._whole[1]
        pairs = [(name, t) for name, t in model.state_dict().items()]
        if all(_whole_here(t) for _, t in pairs):
            self._whole = (model, [(name, full_tensor(t)) for name, t in pairs])
            return self._whole[1]
        return ((name, full_tensor(t)) for name, t in pairs)

    def forget_sources(self) -> None:
        """Walk the model again at the next fill (after its tensors were replaced, e.g. by a checkpoint load)."""
        self._whole = None

    @torch.no_grad()
    def fill_from(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict | None:
        """Copy (name, whole tensor) pairs into the buffer; the sender returns the JSON table."""
        # One foreach call (casting as copy_ does) per COPY_BUCKET_BYTES, not a launch per tensor from Python; the
        # bucket bounds the gathered tensors (a sharded model's are fresh copies) held at once.
        views: list[torch.Tensor] = []
        fulls: list[torch.Tensor] = []
        held = 0
        for name, full in tensors:  # every rank walks all of them: each gather is a collective
            if self.flat is None:
                continue
            views.append(self._views[name])
            fulls.append(full)
            held += full.nbytes
            if held >= COPY_BUCKET_BYTES:
                foreach_copy(views, fulls)
                views, fulls, held = [], [], 0
        if self.flat is None:
            return None
        if views:
            foreach_copy(views, fulls)
        # Engines read the buffer from another process, outside this stream's order: finish the copies first.
        torch.cuda.current_stream(self.flat.device).synchronize()
        return self.weights.to_json()
