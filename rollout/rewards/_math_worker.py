"""The math-verify check that runs in a worker process of `rollout.rewards.math_verifier`'s pool.

sympy can hang on inputs like 10^{10^{10}}. In a worker process math-verify's own signal-based timeouts work (its
main thread), and the pool kills the worker if the call passes its hard deadline.
"""

import logging


def _as_latex(text: str) -> str:
    """math-verify only finds bare LaTeX (\\frac, \\sqrt) inside $...$ or \\boxed{}: wrap it."""
    if "\\" in text and "$" not in text and "\\boxed" not in text:
        return f"${text}$"
    return text


def load() -> None:
    """A worker's initializer: the import (seconds on a loaded machine) must not count against a check's deadline."""
    logging.disable(logging.WARNING)  # math-verify logs every timeout; the caller reports failures
    import math_verify  # noqa: F401, PLC0415 - imported in the workers only


def check(pred: str, gold: str, timeout: int) -> dict[str, bool]:
    """{'correct', 'pred_parsed', 'gold_parsed'} for a predicted and a ground-truth answer text."""
    from math_verify import parse, verify  # noqa: PLC0415 - loaded by `load`

    gold_parsed = parse(_as_latex(gold), parsing_timeout=timeout)
    pred_parsed = parse(_as_latex(pred), parsing_timeout=timeout)
    correct = bool(gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    return {"correct": correct, "pred_parsed": bool(pred_parsed), "gold_parsed": bool(gold_parsed)}
