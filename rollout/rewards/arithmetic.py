"""Verifier of the built-in `arithmetic` task: the last number of the (tagged) answer equals the result."""

from __future__ import annotations

from typing import Any

from rollout.rewards.answer import answer_text, last_number


def arithmetic_reward(sample: Any, response: str, answer: Any, **metadata: Any) -> dict[str, float]:
    """1.0 when the answer's last number equals `answer` (an int or its decimal string), else 0.0."""
    text, tagged = answer_text(response)
    value = last_number(text)
    try:
        expected = int(str(answer).strip())
    except ValueError as exc:
        raise ValueError(f"arithmetic: ground-truth answer {answer!r} is not an integer") from exc
    return {
        "reward": 1.0 if value is not None and value == expected else 0.0,
        "answer_found": float(value is not None),
        "answer_tagged": float(tagged),
    }
