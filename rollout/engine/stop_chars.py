"""Which new tokens can complete a stop string: the engine decodes a request's tail only after those.

The rule (exact, for the decoders `piece_join` vouches for): the tail after token m is the text before it (P, the
tail's other tokens) followed by the token's own text t. P holds no stop string when the tail before token m held
none: P's tokens are a suffix of that tail's, and dropping leading tokens only drops leading text (byte-level: it may
also turn the leading bytes of a split character into U+FFFD, which no vouched-for stop string contains). So a stop
string S in P + t must end inside t, and t contains S's last character. A token is flagged when its text could
contain that character: its text alone contains it, or contains U+FFFD (a byte-level token holding part of a
character: its text exists only in context), or is empty. Everything else decodes the tail as before (stop.py).
"""

from __future__ import annotations

from typing import Any

from rollout.engine.stop import MAX_CACHED_WINDOWS, decode_tails

REPLACEMENT = "\ufffd"


def piece_join(tokenizer: Any) -> str | None:
    """How the stop check's decode (stop._decoder) joins token texts, where that is known exactly: "bytes" (a
    byte-level decoder: the tokens' bytes concatenated, then decoded as UTF-8 with U+FFFD for invalid bytes),
    "spaced" (no decoder: token strings joined by single spaces), or None (anything else, e.g. SentencePiece's
    leading-space handling or transformers' clean-up of spaces: no token is ever skipped)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    from tokenizers import decoders  # noqa: PLC0415 - only engines with a fast tokenizer get here

    decoder = backend.decoder
    if decoder is None:
        return "spaced"
    if isinstance(decoder, decoders.ByteLevel):
        return "bytes"
    return None


class StopCompleters:
    """Per tokenizer: for a set of stop strings, which token ids may complete one of them (cached)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.join = piece_join(tokenizer)
        self._texts: list[str] | None = None  # each id's text alone, decoded once on first use
        self._by_char: dict[str, bytes] = {}
        self._by_strings: dict[tuple[str, ...], bytes | None] = {}

    def mask(self, stop_strings: list[str]) -> bytes | None:
        """mask[id] == 1 when token `id` may complete one of stop_strings (ids past the mask may too); None when
        every token may (the decoder is not vouched for, or a stop string is empty or holds U+FFFD)."""
        key = tuple(stop_strings)
        if key in self._by_strings:
            return self._by_strings[key]
        mask = self._mask(stop_strings)
        if len(self._by_strings) < MAX_CACHED_WINDOWS:
            self._by_strings[key] = mask
        return mask

    def _mask(self, stop_strings: list[str]) -> bytes | None:
        if self.join is None or any(not s or REPLACEMENT in s for s in stop_strings):
            return None
        lasts = {s[-1] for s in stop_strings}
        if self.join == "spaced" and any(c.isspace() for c in lasts):
            return None  # the separator before every token
        masks = [self._char_mask(c) for c in sorted(lasts)]
        if len(masks) == 1:
            return masks[0]
        return bytes(max(flags) for flags in zip(*masks))

    def _char_mask(self, char: str) -> bytes:
        mask = self._by_char.get(char)
        if mask is None:
            if self._texts is None:
                size = self.tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=True)
                self._texts = decode_tails(self.tokenizer, [[i] for i in range(size)])
            mask = bytes(not text or char in text or REPLACEMENT in text for text in self._texts)
            self._by_char[char] = mask
        return mask
