"""Teachers for on-policy distillation: expert models that score the student's samples by prefill only.

  scoring.py  the /generate scoring request and its reply (SGLang's input_token_logprobs, input_top_logprobs)
  direct.py   a teacher on engines of its own, with retries and restarts
  swap.py     teachers sharing one engine, swapped in from pinned CPU memory in turns
  pool.py     every teacher of a run by domain; fills a group's samples
  stats.py    per-teacher counters (tokens, busy time, retries, restarts, swaps)
"""

from rollout.teachers.direct import DirectScorer, TeacherUnavailableError
from rollout.teachers.pool import TeacherPool
from rollout.teachers.scoring import TeacherScores, parse_scores, score_payload
from rollout.teachers.swap import SwapEngine, teacher_version

__all__ = ["DirectScorer", "SwapEngine", "TeacherPool", "TeacherScores", "TeacherUnavailableError", "parse_scores",
           "score_payload", "teacher_version"]
