"""When a request is finished: length, min_new_tokens guard, stop token, stop string.

The length limit is the one place a request's token budget is decided (`max_new_tokens` here): the request's
max_new_tokens capped by the room left in the model's context. The engine reserves cache blocks for exactly that
many tokens, and the limit wins over min_new_tokens (SGLang checks min first, so min > max would run past both).

Stop strings are looked for in the decoded tail of the output (the last `window` tokens, window = the
longest stop string's token count + 1, as SGLang does), so a step costs one short decode per request.
The matched EOS / stop token stays in output_ids; `trim_matched_stop` trims only the text.
"""

from __future__ import annotations

from typing import Any

from rollout.engine.types import RequestError, SamplingParams


class StopChecker:
    """Per-request stop rules; `check(output_ids)` returns a finish_reason dict or None."""

    def __init__(self, params: SamplingParams, eos_token_ids: list[int], tokenizer: Any = None, *, prompt_len: int = 0,
                 context: int | None = None) -> None:
        self.params = params
        room = params.max_new_tokens if context is None else context - prompt_len
        self.max_new_tokens = max(0, min(params.max_new_tokens, room))
        self.min_new_tokens = min(params.min_new_tokens, self.max_new_tokens)
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_token_ids))
        self.stop_strings = list(params.stop)
        self.tokenizer = tokenizer
        self.window = 0
        if self.stop_strings:
            if tokenizer is None:
                raise RequestError("sampling_params.stop needs an engine started with a tokenizer")
            longest = max(len(tokenizer.encode(s, add_special_tokens=False)) for s in self.stop_strings)
            self.window = max(longest, max(len(s) for s in self.stop_strings)) + 1

    @property
    def masked_ids(self) -> list[int]:
        """Tokens masked out while the output is shorter than min_new_tokens."""
        return sorted(self.stop_ids)

    def check(self, output_ids: list[int]) -> dict | None:
        n = len(output_ids)
        if n >= self.max_new_tokens:
            return {"type": "length", "length": self.max_new_tokens}
        if n < self.min_new_tokens:
            return None
        last = output_ids[-1]
        if last in self.stop_ids:
            return {"type": "stop", "matched": last}
        if self.stop_strings:
            tail = self.tokenizer.decode(output_ids[-self.window :], skip_special_tokens=False)
            for s in self.stop_strings:
                if s in tail:
                    return {"type": "stop", "matched": s}
        return None

    def final_text(self, output_ids: list[int], finish_reason: dict | None) -> str | None:
        """The decoded output, trimmed at a matched stop string unless no_stop_trim; None without a tokenizer."""
        if self.tokenizer is None:
            return None
        text = self.tokenizer.decode(output_ids, skip_special_tokens=self.params.skip_special_tokens)
        return trim_matched_stop(text, finish_reason, self.params.no_stop_trim)


def trim_matched_stop(text: str, finish_reason: dict | None, no_stop_trim: bool) -> str:
    """SGLang's rule: cut the text at the first occurrence of a matched stop string (token ids are never cut)."""
    if no_stop_trim or not finish_reason:
        return text
    matched = finish_reason.get("matched")
    if isinstance(matched, str):
        pos = text.find(matched)
        return text[:pos] if pos != -1 else text
    return text
