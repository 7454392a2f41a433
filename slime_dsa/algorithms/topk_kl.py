"""Sparse KL over a teacher's top-k plus a tail bucket (the top-k transfer option of on-policy distillation, §7).

At each position the teacher returns its k most likely ids with their log-probs; the student's log-probs at the
same ids come from the trainer's forward. Both distributions are coarsened to k + 1 buckets, the k ids and a tail
that holds the rest of the mass (1 − Σ_k p), and the KL is taken between the two bucket distributions:
  reverse (student ‖ teacher):  Σ_i p_i (log p_i − log q_i) + p_tail (log p_tail − log q_tail)
  forward (teacher ‖ student):  Σ_i q_i (log q_i − log p_i) + q_tail (log q_tail − log p_tail)
By the data-processing inequality it is at most the full-vocabulary KL, and equal to it when the k ids hold all
the mass of both. A tail below TAIL_FLOOR counts as TAIL_FLOOR (a teacher whose top-k holds every bit of its mass
would make the reverse KL infinite).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from slime_dsa.algorithms.utils import masked_mean, upcast

KLDirection = Literal["reverse", "forward"]
TAIL_FLOOR = 1e-8
_LOG_TAIL_FLOOR = math.log(TAIL_FLOOR)
_LOG_2 = math.log(2.0)


def log_tail_mass(topk_logprobs: torch.Tensor) -> torch.Tensor:
    """(…,) log(1 − Σ_k exp(topk_logprobs)) over the last dim, floored at log(TAIL_FLOOR); stable near 0 and 1."""
    lse = torch.logsumexp(upcast(topk_logprobs), dim=-1).clamp(max=0.0)  # log Σ p ≤ 0
    # log(1 − e^x): log(−expm1(x)) near x = 0, log1p(−e^x) far from it (Mächler's log1mexp). Each branch sees
    # only its own range: torch.where sends a zero gradient into the unused one, and 0 · inf there (log1p(−1) at
    # an x whose e^x rounds to 1) would make the whole gradient NaN.
    near = torch.log(-torch.expm1(lse.clamp(min=-_LOG_2, max=-1e-30)))
    far = torch.log1p(-torch.exp(lse.clamp(max=-_LOG_2)))
    return torch.where(lse > -_LOG_2, near, far).clamp(min=_LOG_TAIL_FLOOR)


def sparse_topk_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                   direction: KLDirection = "reverse") -> torch.Tensor:
    """(…,) KL between the (k + 1)-bucket coarsenings of two distributions, from their log-probs at the same k
    ids (…, k); differentiable in both."""
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(f"student_logprobs {tuple(student_logprobs.shape)} and teacher_logprobs "
                         f"{tuple(teacher_logprobs.shape)} must have the same shape (…, k)")
    if direction not in ("reverse", "forward"):
        raise ValueError(f"direction must be reverse or forward, got {direction!r}")
    s, t = upcast(student_logprobs), upcast(teacher_logprobs)
    s_tail, t_tail = log_tail_mass(s), log_tail_mass(t)
    if direction == "forward":
        s, t, s_tail, t_tail = t, s, t_tail, s_tail
    head = (s.exp() * (s - t)).sum(-1)
    return head + s_tail.exp() * (s_tail - t_tail)


def topk_tail_metrics(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                      mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean tail mass (1 − Σ_k p) of the student and of the teacher over rows where mask is 1."""
    return {"topk_tail_student": masked_mean(log_tail_mass(student_logprobs.detach()).exp(), mask),
            "topk_tail_teacher": masked_mean(log_tail_mass(teacher_logprobs.detach()).exp(), mask)}
