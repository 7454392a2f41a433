"""Lenient answer extraction shared by the verifiers.

Convention: a response ends with its answer, optionally inside `<answer>...</answer>`. The content of the LAST
tagged answer wins; an `<answer>` left open at the end (the model hit max length or stop trimmed the tag) counts up
to the end of the text. Without tags each verifier reads the end of the response (the last number, the last line).
Reading only the tail bounds the work a pathological response can cause.
"""

from __future__ import annotations

import re

MAX_ANSWER_CHARS = 1000  # longer extracted answers are cut to their last MAX_ANSWER_CHARS characters

_TAGGED = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_OPEN_TAG = re.compile(r"<answer>", re.IGNORECASE)
# A minus sign counts only where it cannot be a binary operator (not after a letter, digit or ')').
_NUMBER = re.compile(r"(?:(?<![\w)])[-−])?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def extract_tagged(response: str) -> str | None:
    """The stripped content of the last `<answer>...</answer>` (or of a final unclosed `<answer>`), else None."""
    closed = list(_TAGGED.finditer(response))
    tail_start = closed[-1].end() if closed else 0
    opened = [m.end() for m in _OPEN_TAG.finditer(response, tail_start)]
    if opened:
        return response[opened[-1]:].strip()[-MAX_ANSWER_CHARS:]
    if closed:
        return closed[-1].group(1).strip()[-MAX_ANSWER_CHARS:]
    return None


def answer_text(response: str) -> tuple[str, bool]:
    """(the text to verify, whether it came from answer tags): the tagged answer, else the response's tail."""
    tagged = extract_tagged(response)
    if tagged is not None:
        return tagged, True
    return response.strip()[-MAX_ANSWER_CHARS:], False


def last_number(text: str) -> float | int | None:
    """The last number written in `text` ("1,234" → 1234, "−7" → -7, "2.50" → 2.5), or None."""
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    token = matches[-1].replace(",", "").replace("−", "-")
    value = float(token) if "." in token else int(token)
    return int(value) if isinstance(value, float) and value.is_integer() else value
