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

import torch

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


def shared_prompt_lengths(input_ids: torch.Tensor | list[int], seqlens: list[int], prompt_lens: list[int]) -> list[int]:
    """Per sample, the prompt tokens it shares with the sample before it: its whole prompt when the two prompts are
    equal, else 0 (the grouping rule of pack_shared_prefixes)."""
    flat = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else input_ids
    out, start, prev = [], 0, None
    for n, p in zip(seqlens, prompt_lens):
        same = prev is not None and prev[1] == p and flat[prev[0]:prev[0] + p] == flat[start:start + p]
        out.append(p if same else 0)
        prev, start = (start, p), start + n
    return out


def pack_shared_prefixes(input_ids: torch.Tensor, seqlens: list[int], prompt_lens: list[int],
                         device: torch.device | str = "cpu") -> SharedPrefixPack | None:
    """The shared-prompt layout of a flat pack, or None when no two consecutive samples share a prompt.

    input_ids (T,) flat, samples in order with seqlens[i] tokens, the first prompt_lens[i] of them the prompt.
    Samples share when they are consecutive and their prompt tokens are equal.
    """
    if len(seqlens) != len(prompt_lens):
        raise ValueError(f"{len(seqlens)} seqlens but {len(prompt_lens)} prompt_lens")
    flat = input_ids.tolist()
    starts = [0]
    for n in seqlens:
        starts.append(starts[-1] + n)
    for i, p in enumerate(prompt_lens):
        if not 0 < p <= seqlens[i]:
            raise ValueError(f"sample {i}: prompt_lens {p} must be in [1, {seqlens[i]}]")
    groups: list[list[int]] = []
    for i, shared in enumerate(shared_prompt_lengths(flat, seqlens, prompt_lens)):
        if shared:
            groups[-1].append(i)
        else:
            groups.append([i])
    if all(len(g) == 1 for g in groups):
        return None

    ids: list[int] = []
    positions: list[int] = []
    lens_q: list[int] = []
    lens_k: list[int] = []
    key_rows: list[int] = []
    source = [0] * starts[-1]  # flat token -> tree row
    for group in groups:
        first = group[0]
        p = prompt_lens[first]
        prompt_row = len(ids)
        ids += flat[starts[first]:starts[first] + p]
        positions += range(p)
        lens_q.append(p)
        lens_k.append(p)
        key_rows += range(prompt_row, prompt_row + p)
        for i in group:
            source[starts[i]:starts[i] + p] = range(prompt_row, prompt_row + p)
            r = seqlens[i] - p
            if r == 0:
                continue
            row = len(ids)
            ids += flat[starts[i] + p:starts[i + 1]]
            positions += range(p, p + r)
            lens_q.append(r)
            lens_k.append(p + r)
            key_rows += list(range(prompt_row, prompt_row + p)) + list(range(row, row + r))
            source[starts[i] + p:starts[i + 1]] = range(row, row + r)

    response_index = [t for i in range(len(seqlens)) for t in range(starts[i] + prompt_lens[i], starts[i + 1])]
    response_rows = [source[t - 1] for t in response_index]  # t - 1 is in the same sample: prompt_lens >= 1
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    cu_q = torch.nn.functional.pad(as_long(lens_q).cumsum(0), (1, 0))
    cu_k = torch.nn.functional.pad(as_long(lens_k).cumsum(0), (1, 0))
    batch = PackedBatch(positions=as_long(positions), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                        kv_cache=GatheredKeys(as_long(key_rows)))
    return SharedPrefixPack(as_long(ids), batch, as_long(response_index), as_long(response_rows))
