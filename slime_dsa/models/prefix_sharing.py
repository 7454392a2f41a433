"""Shared-prompt packing for training: the n samples of a GRPO group share their prompt, so compute it once.

Flat packing runs every sample's prompt through the model again (n times per group). Here each distinct prompt
is one sequence, and each response is a sequence whose queries are its own tokens and whose keys are the
prompt's rows followed by its own, exactly like a prefill over a cached prefix in the engine (queries are the
last rows of their sequence). The keys are gathered from this same forward with `index_select`, so gradients
from every response flow back into the shared prompt rows: the loss and its gradient are those of the flat
pack, with the prompt's forward and backward done once per group instead of n times.

`SharedPrefixPack.response_index` / `response_rows` map back to the flat layout: for every response token, its
flat position and the hidden row whose logits give its log-prob. Prompt tokens get no log-prob (0): every
sample's prompt is context, never trained on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slime_dsa.devices import upload_many
from slime_dsa.models.glm_moe_dsa import PackedBatch


class GatheredKeys:
    """A KVCache stand-in: every sequence's key rows gathered (differentiably) from this forward's own rows."""

    def __init__(self, key_rows: torch.Tensor) -> None:
        self.key_rows = key_rows  # (Tk,) rows of this forward, in cu_seqlens_k layout

    def update(self, layer_idx: int, kv: torch.Tensor, index_k: torch.Tensor | None):
        return kv.index_select(0, self.key_rows), None if index_k is None else index_k.index_select(0, self.key_rows)


@dataclass
class SharedPrefixPack:
    """A flat pack of samples re-laid so that each run of samples with one prompt computes it once."""

    input_ids: torch.Tensor  # (Tt,) each distinct prompt once, then the responses that follow it
    batch: PackedBatch  # over those rows; keys gathered by GatheredKeys
    response_index: torch.Tensor  # (R,) flat positions of the response tokens
    response_rows: torch.Tensor  # (R,) the row predicting each of them (the row of the token before it)

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.numel())


def concat_ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The concatenation of arange(start, start + length) over the pairs, (sum(lengths),) long (host tensors)."""
    lengths_np = lengths.numpy()
    # Element j of range i is its start plus j minus the elements of the ranges before it.
    shift = starts.numpy() - (np.cumsum(lengths_np) - lengths_np)
    return torch.from_numpy(np.arange(int(lengths_np.sum()), dtype=np.int64) + np.repeat(shift, lengths_np))


def _repeat(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """torch.repeat_interleave(values, counts) of host tensors, by numpy's repeat (several times faster on a CPU)."""
    return torch.from_numpy(np.repeat(values.numpy(), counts.numpy()))


def _check_prompt_lens(seqlens: list[int], prompt_lens: list[int]) -> None:
    if len(seqlens) != len(prompt_lens):
        raise ValueError(f"{len(seqlens)} seqlens but {len(prompt_lens)} prompt_lens")
    for i, (n, p) in enumerate(zip(seqlens, prompt_lens)):
        if not 0 < p <= n:
            raise ValueError(f"sample {i}: prompt_lens {p} must be in [1, {n}]")


def _shares_with_previous(ids: torch.Tensor, lens: torch.Tensor, plens: torch.Tensor) -> torch.Tensor:
    """(S,) bool: sample i's prompt equals sample i - 1's (same length, same tokens)."""
    starts = lens.cumsum(0) - lens
    same = torch.zeros(len(lens), dtype=torch.bool)
    same[1:] = plens[1:] == plens[:-1]
    candidates = same.nonzero().squeeze(1)
    p = plens[candidates]
    differ = ids[concat_ranges(starts[candidates], p)] != ids[concat_ranges(starts[candidates - 1], p)]
    owner = _repeat(torch.arange(len(candidates)), p)
    same[candidates] = torch.zeros(len(candidates), dtype=torch.long).index_add_(0, owner, differ.long()) == 0
    return same


def shared_prompt_lengths(input_ids: torch.Tensor | list[int], seqlens: list[int], prompt_lens: list[int]) -> list[int]:
    """Per sample, the prompt tokens it shares with the sample before it: its whole prompt when the two prompts are
    equal, else 0 (the grouping rule of pack_shared_prefixes)."""
    _check_prompt_lens(seqlens, prompt_lens)
    plens = torch.tensor(prompt_lens, dtype=torch.long)
    same = _shares_with_previous(torch.as_tensor(input_ids), torch.tensor(seqlens, dtype=torch.long), plens)
    return torch.where(same, plens, 0).tolist()


def pack_shared_prefixes(input_ids: torch.Tensor, seqlens: list[int], prompt_lens: list[int],
                         device: torch.device | str = "cpu") -> SharedPrefixPack | None:
    """The shared-prompt layout of a flat pack, or None when no two consecutive samples share a prompt.

    input_ids (T,) flat, samples in order with seqlens[i] tokens, the first prompt_lens[i] of them the prompt.
    Samples share when they are consecutive and their prompt tokens are equal. Built by tensor ops on the host
    (no loop over samples or tokens), then uploaded.
    """
    _check_prompt_lens(seqlens, prompt_lens)
    ids = input_ids.cpu()
    lens, plens = torch.tensor(seqlens, dtype=torch.long), torch.tensor(prompt_lens, dtype=torch.long)
    first = ~_shares_with_previous(ids, lens, plens)  # (S,) the first sample of each run sharing a prompt
    if bool(first.all()):
        return None
    starts = lens.cumsum(0) - lens  # (S,) flat row of each sample
    resp = lens - plens  # (S,) response tokens
    prompt_q = torch.where(first, plens, 0)  # (S,) a run's prompt is a sequence of its first sample
    # Sequences in order: per sample its run's prompt (first samples only), then its response (if any).
    slot_q = torch.stack([prompt_q, resp], 1).reshape(-1)  # (2S,) query rows of each slot, 0 = no sequence
    slot_row = slot_q.cumsum(0) - slot_q  # (2S,) first row of each slot in the new layout
    prompt_row, resp_row = slot_row[0::2], slot_row[1::2]  # (S,) each
    prompt_row = prompt_row[first.nonzero().squeeze(1)][first.long().cumsum(0) - 1]  # (S,) the run's prompt rows
    tokens = concat_ranges(torch.stack([starts, starts + plens], 1).reshape(-1), slot_q)  # (Tt,) flat token per row
    positions = tokens - _repeat(starts.repeat_interleave(2), slot_q)
    present = slot_q > 0
    lens_q = slot_q[present]
    lens_k = torch.stack([prompt_q, plens + resp], 1).reshape(-1)[present]
    # Keys: a prompt sequence its own rows; a response the run's prompt rows, then its own rows.
    key_rows = concat_ranges(torch.stack([prompt_row, prompt_row, resp_row], 1).reshape(-1),
                             torch.stack([prompt_q, torch.where(resp > 0, plens, 0), resp], 1).reshape(-1))
    source = concat_ranges(torch.stack([prompt_row, resp_row], 1).reshape(-1),
                           torch.stack([plens, resp], 1).reshape(-1))  # (T,) flat token -> its row
    response_index = concat_ranges(starts + plens, resp)  # (R,) flat response tokens
    response_rows = source[response_index - 1]  # t - 1 is in the same sample: prompt_lens >= 1
    cu_q, cu_k = (torch.nn.functional.pad(lens.cumsum(0), (1, 0)) for lens in (lens_q, lens_k))
    host_cu = (cu_q.tolist(), cu_k.tolist())  # host tensors: no sync
    cu_q, cu_k, positions, key_rows, ids, response_index, response_rows = upload_many(
        [cu_q, cu_k, positions, key_rows, ids[tokens], response_index, response_rows], device)
    batch = PackedBatch(positions=positions, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, kv_cache=GatheredKeys(key_rows),
                        host_cu_seqlens=host_cu)
    return SharedPrefixPack(ids, batch, response_index, response_rows)
