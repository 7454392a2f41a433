"""Per-token log-probs (and entropy) over a vocabulary split across tensor-parallel ranks, chunked over rows.

Each rank holds logits for V / tp tokens; the log-partition, the target's logit and the entropy's sum are
all-reduced with megatron's reduce_from_tensor_model_parallel_region (forward sum, backward copy), so every rank
gets the whole result and the gradient of its own logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_start: int, temperature: float,
           want_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = (hidden @ weight.T).float() / temperature  # (C, V / tp)
    peak = logits.detach().max(dim=-1).values
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    sumexp = reduce_from_tensor_model_parallel_region(torch.exp(logits - peak[:, None]).sum(-1))
    logz = torch.log(sumexp) + peak  # (C,)
    local = targets - vocab_start
    mine = (local >= 0) & (local < logits.shape[-1])
    picked = logits.gather(1, local.clamp(0, logits.shape[-1] - 1)[:, None]).squeeze(1) * mine
    logp = reduce_from_tensor_model_parallel_region(picked) - logz
    if not want_entropy:
        return logp, logp.new_zeros(())
    expected = reduce_from_tensor_model_parallel_region((torch.exp(logits - logz[:, None]) * logits).sum(-1))
    return logp, logz - expected


def vocab_parallel_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                            chunk_size: int = 1024, return_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden (N, D) whole on every rank, weight (V / tp, D) this rank's vocabulary rows, targets (N,) ->
    (logprobs (N,) float32, entropy (N,) or None), as slime_dsa.models.logprobs.chunked_token_logprobs."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    vocab_start = parallel_state.get_tensor_model_parallel_rank() * weight.shape[0]
    logps, ents = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        logp, ent = _chunk(hidden[start : start + chunk_size], weight, targets[start : start + chunk_size], vocab_start,
                           temperature, return_entropy)
        logps.append(logp)
        ents.append(ent)
    logp = torch.cat(logps) if logps else hidden.new_zeros(0, dtype=torch.float32)
    return logp, (torch.cat(ents) if return_entropy and ents else None)
