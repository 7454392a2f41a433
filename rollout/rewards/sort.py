"""Verifier of the built-in `sort` task: the (tagged) answer lists exactly the given numbers, smallest first."""

from __future__ import annotations

import json
import re
from typing import Any

from rollout.rewards.answer import answer_text

_INTEGER = re.compile(r"-?\d+")


def sort_reward(sample: Any, response: str, answer: Any, **metadata: Any) -> dict[str, float]:
    """1.0 when the integers of the answer equal the sorted list `answer`, in order; else 0.0."""
    if isinstance(answer, str):  # a dataset file may store the list as a JSON string
        answer = json.loads(answer)
    expected = [int(n) for n in answer]
    text, tagged = answer_text(response)
    if not tagged:
        text = text.splitlines()[-1] if text else ""  # untagged: the last line is the list
    found = [int(n) for n in _INTEGER.findall(text)]
    return {"reward": 1.0 if found == expected else 0.0, "answer_found": float(bool(found)),
            "answer_tagged": float(tagged)}
