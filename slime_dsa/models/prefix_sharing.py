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


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of arange(start, start + length) over the pairs of int64 arrays, (sum(lengths),) int64."""
    # Element j of range i is its start plus j minus the elements of the ranges before it.
    shift = starts - (np.cumsum(lengths) - lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(shift, lengths)


def _check_prompt_lens(seqlens: list[int], prompt_lens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(seqlens, prompt_lens) as int64 arrays, once every prompt length is in [1, its sample's length]."""
    if len(seqlens) != len(prompt_lens):
        raise ValueError(f"{len(seqlens)} seqlens but {len(prompt_lens)} prompt_lens")
    lens, plens = np.asarray(seqlens, dtype=np.int64), np.asarray(prompt_lens, dtype=np.int64)
    bad = np.flatnonzero((plens <= 0) | (plens > lens))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"sample {i}: prompt_lens {plens[i]} must be in [1, {lens[i]}]")
    return lens, plens


def _shares_with_previous(ids: np.ndarray, lens: np.ndarray, plens: np.ndarray) -> np.ndarray:
    """(S,) bool: sample i's prompt equals sample i - 1's (same length, same tokens)."""
    same = np.zeros(len(lens), dtype=bool)
    same[1:] = plens[1:] == plens[:-1]
    candidates = np.flatnonzero(same)
    if candidates.size:
        p = plens[candidates]
        rows = concat_ranges((np.cumsum(lens) - lens)[candidates], p)  # the candidates' prompt tokens
        differ = ids[rows] != ids[rows - np.repeat(lens[candidates - 1], p)]  # the previous sample's, p rows earlier
        same[candidates] = ~np.logical_or.reduceat(differ, np.cumsum(p) - p)  # every p >= 1: no empty segment
    return same


def shared_prompt_lengths(input_ids: torch.Tensor | list[int], seqlens: list[int], prompt_lens: list[int]) -> list[int]:
    """Per sample, the prompt tokens it shares with the sample before it: its whole prompt when the two prompts are
    equal, else 0 (the grouping rule of pack_shared_prefixes)."""
    lens, plens = _check_prompt_lens(seqlens, prompt_lens)
    ids = input_ids.cpu().numpy() if isinstance(input_ids, torch.Tensor) else np.asarray(input_ids)
    return np.where(_shares_with_previous(ids, lens, plens), plens, 0).tolist()


def pack_shared_prefixes(input_ids: torch.Tensor, seqlens: list[int], prompt_lens: list[int],
                         device: torch.device | str = "cpu") -> SharedPrefixPack | None:
    """The shared-prompt layout of a flat pack, or None when no two consecutive samples share a prompt.

    input_ids (T,) flat, samples in order with seqlens[i] tokens, the first prompt_lens[i] of them the prompt.
    Samples share when they are consecutive and their prompt tokens are equal. Built by numpy array ops on the host
    (no loop over samples or tokens; numpy's per-op cost is a fraction of torch's at these sizes), then uploaded.
    """
    lens, plens = _check_prompt_lens(seqlens, prompt_lens)
    ids = input_ids.cpu()
    first = ~_shares_with_previous(ids.numpy(), lens, plens)  # (S,) the first sample of each run sharing a prompt
    if first.all():
        return None
    starts = np.cumsum(lens) - lens  # (S,) flat row of each sample
    resp = lens - plens  # (S,) response tokens
    prompt_q = np.where(first, plens, 0)  # (S,) a run's prompt is a sequence of its first sample
    # Sequences in order: per sample its run's prompt (first samples only), then its response (if any).
    slot_q = np.stack([prompt_q, resp], 1).reshape(-1)  # (2S,) query rows of each slot, 0 = no sequence
    slot_row = np.cumsum(slot_q) - slot_q  # (2S,) first row of each slot in the new layout
    prompt_row, resp_row = slot_row[0::2], slot_row[1::2]  # (S,) each
    prompt_row = prompt_row[np.flatnonzero(first)][np.cumsum(first) - 1]  # (S,) the run's prompt rows
    tokens = concat_ranges(np.stack([starts, starts + plens], 1).reshape(-1), slot_q)  # (Tt,) flat token per row
    positions = tokens - np.repeat(np.repeat(starts, 2), slot_q)
    present = slot_q > 0
    lens_q = slot_q[present]
    lens_k = np.stack([prompt_q, lens], 1).reshape(-1)[present]  # a response's keys: its prompt and itself
    # Keys: a prompt sequence its own rows; a response the run's prompt rows, then its own rows.
    key_rows = concat_ranges(np.stack([prompt_row, prompt_row, resp_row], 1).reshape(-1),
                             np.stack([prompt_q, np.where(resp > 0, plens, 0), resp], 1).reshape(-1))
    source = concat_ranges(np.stack([prompt_row, resp_row], 1).reshape(-1),
                           np.stack([plens, resp], 1).reshape(-1))  # (T,) flat token -> its row
    response_index = concat_ranges(starts + plens, resp)  # (R,) flat response tokens
    response_rows = source[response_index - 1]  # t - 1 is in the same sample: prompt_lens >= 1
    cu_q, cu_k = (np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(n)]) for n in (lens_q, lens_k))
    host_cu = (cu_q.tolist(), cu_k.tolist())  # host arrays: no sync
    cu_q, cu_k, positions, key_rows, ids, response_index, response_rows = upload_many(
        [torch.from_numpy(a) for a in (cu_q, cu_k, positions, key_rows)] + [ids[torch.from_numpy(tokens)]]
        + [torch.from_numpy(a) for a in (response_index, response_rows)], device)
    batch = PackedBatch(positions=positions, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, kv_cache=GatheredKeys(key_rows),
                        host_cu_seqlens=host_cu)
    return SharedPrefixPack(ids, batch, response_index, response_rows)
