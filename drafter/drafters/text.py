"""Token bytes to text, as UTF-8 that a byte-level token may cut inside a character."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable


def _utf8_decoder() -> codecs.IncrementalDecoder:
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


def complete_text(data: bytes) -> str:
    """`data` as text, leaving out an incomplete character at the end (the next tokens
    complete it)."""
    return _utf8_decoder().decode(data, final=False)


class TextDecoder:
    """Token ids to text, incrementally: a character split across tokens waits for its
    last byte."""

    def __init__(self, token_bytes: Callable[[int], bytes]):
        self._token_bytes = token_bytes
        self._utf8 = _utf8_decoder()

    def feed(self, tokens: Iterable[int]) -> str:
        return self._utf8.decode(b"".join(self._token_bytes(t) for t in tokens))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
