"""When a request is finished: length, min_new_tokens guard, stop token, stop string.

The length limit is the one place a request's token budget is decided (`max_new_tokens` here): the request's
max_new_tokens capped by the room left in the model's context. The engine reserves cache blocks for exactly that
many tokens, and the limit wins over min_new_tokens (SGLang checks min first, so min > max would run past both).

Stop strings are looked for in the decoded tail of the output (the last `window` tokens, window = the
longest stop string's token count + 1, as SGLang does): a step costs one batched decode of short tails, over the
requests that have stop strings only, and only after a new token whose text may complete one of them
(`may_match_after`, stop_chars.py).
The matched EOS / stop token stays in output_ids; the response's text is trimmed (rollout.server.protocol.response_text).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollout.engine.types import RequestError, SamplingParams


MAX_CACHED_WINDOWS = 4096  # distinct sets of stop strings an engine remembers the window of


def engine_eos_token_ids(config_ids: list[int], generation_ids: list[int], tokenizer: Any = None) -> list[int]:
    """The ids that end an answer unless it asks ignore_eos, as SGLang's Req stops: config.json's eos_token_id,
    generation_config.json's, the tokenizer's eos_token and (SGLang's attach_additional_stop_token_ids) <|eom_id|>."""
    ids = [*config_ids, *generation_ids]
    if tokenizer is not None:
        ids.append(getattr(tokenizer, "eos_token_id", None))
        added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
        ids.append(added.get("<|eom_id|>"))
    return list(dict.fromkeys(i for i in ids if i is not None))


def stop_window(tokenizer: Any, stop_strings: list[str]) -> int:
    """Tokens of output whose text can hold a stop string that its last token completes."""
    longest = max(len(tokenizer.encode(s, add_special_tokens=False)) for s in stop_strings)
    return max(longest, max(len(s) for s in stop_strings)) + 1


class StopChecker:
    """Per-request stop rules; `check(output_ids)` returns a finish_reason dict or None."""

    def __init__(self, params: SamplingParams, eos_token_ids: list[int], tokenizer: Any = None, *, prompt_len: int = 0,
                 context: int | None = None, windows: dict[tuple[str, ...], int] | None = None,
                 completing: Callable[[list[str]], bytes | None] | None = None) -> None:
        """windows: a cache of the tail length per set of stop strings, shared by the requests of one tokenizer;
        completing: stop strings -> which tokens may complete one (stop_chars.StopCompleters.mask, for that
        tokenizer; for `may_match_after`)."""
        self.params = params
        room = params.max_new_tokens if context is None else context - prompt_len
        self.max_new_tokens = max(0, min(params.max_new_tokens, room))
        self.min_new_tokens = min(params.min_new_tokens, self.max_new_tokens)
        # As SGLang: ignore_eos turns off every stop token (Req.check_finished), and min_new_tokens masks the request's
        # stop ids and the EOS ids either way (its min_new_tokens penalizer).
        self.masked_ids = frozenset(params.stop_token_ids) | frozenset(eos_token_ids)
        self.stop_ids = frozenset() if params.ignore_eos else self.masked_ids
        self.stop_strings = list(params.stop)
        self.tokenizer = tokenizer
        self.window = 0
        self.completing: bytes | None = None  # [id] == 1: the token may complete a stop string; None: every token may
        if self.stop_strings:
            if tokenizer is None:
                raise RequestError("sampling_params.stop needs an engine started with a tokenizer")
            key = tuple(self.stop_strings)
            window = None if windows is None else windows.get(key)
            if window is None:
                window = stop_window(tokenizer, self.stop_strings)
                if windows is not None and len(windows) < MAX_CACHED_WINDOWS:
                    windows[key] = window
            self.window = window
            if completing is not None:
                self.completing = completing(self.stop_strings)

    def check(self, output_ids: list[int]) -> dict | None:
        """The finish reason after the last of output_ids, or None. The engine runs the same rules batched: lengths
        and stop tokens on the device (rows.SamplingRows.finish_codes), stop strings through `match_stop_strings`."""
        n = len(output_ids)
        if n >= self.max_new_tokens:
            return {"type": "length", "length": self.max_new_tokens}
        if n < self.min_new_tokens:
            return None
        last = output_ids[-1]
        if last in self.stop_ids:
            return {"type": "stop", "matched": last}
        if self.stop_strings:
            return self.matched_string(decode_tails(self.tokenizer, [output_ids[-self.window :]])[0])
        return None

    def may_match_after(self, token: int, num_output: int) -> bool:
        """Whether the tail may hold a stop string now that `token` made the output num_output tokens long; False
        only when the tail was checked (or empty) one token earlier and `token` cannot complete a stop string."""
        mask = self.completing
        return mask is None or num_output <= self.min_new_tokens or not 0 <= token < len(mask) or mask[token] == 1

    def matched_string(self, tail: str) -> dict | None:
        """The finish reason of the first stop string found in the decoded tail, or None."""
        for s in self.stop_strings:
            if s in tail:
                return {"type": "stop", "matched": s}
        return None


def match_stop_strings(stops: list[StopChecker], tails: list[list[int]]) -> list[dict | None]:
    """For requests with stop strings whose outputs reached min_new_tokens: the finish reason of each, from one
    batched decode of their tails (each request's last `window` output tokens; the requests share the engine's
    tokenizer)."""
    if not stops:
        return []
    reasons: list[dict | None] = []
    for stop, text in zip(stops, decode_tails(stops[0].tokenizer, tails)):
        reason = None
        for s in stop.stop_strings:
            if s in text:
                reason = {"type": "stop", "matched": s}
                break
        reasons.append(reason)
    return reasons


def decode_tails(tokenizer: Any, tails: list[list[int]]) -> list[str]:
    """tokenizer.decode(tail, skip_special_tokens=False) of each tail (as `decode_ids`). A loop: the backend's
    decode_batch hands the tails to a thread pool, which costs more than it saves on tails this short."""
    decode = _decoder(tokenizer)
    return [decode(tail, False) for tail in tails]


def decode_ids(tokenizer: Any, ids: list[int], skip_special_tokens: bool) -> str:
    """tokenizer.decode(ids, skip_special_tokens=...), through the fast tokenizer's backend where that is the same."""
    return _decoder(tokenizer)(ids, skip_special_tokens)


def _decoder(tokenizer: Any) -> Callable[[list[int], bool], str]:
    """(ids, skip_special_tokens) -> text: straight through a fast tokenizer's backend when transformers' decode would
    add nothing to the backend's text (no clean-up of spaces), skipping its per-id conversions."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return backend.decode
    return lambda ids, skip_special_tokens: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
