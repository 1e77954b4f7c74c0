"""A generation's text on its way out: tokens decoded to text (a character split across
tokens waits for its last byte), stop sequences held back while one may be forming, and,
where the client asked for logprobs, each token's attached to the text it begins in (a
token after a stop sequence never goes out, nor does its logprob)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from drafter.drafters.text import TextDecoder
from drafter.serve.stops import StopScanner
from server.shared.protocol import TokenLogprob


@dataclass(frozen=True)
class Spelled:
    """A generated token's logprob, spelled out: its text and bytes, where its text begins
    in the choice's (characters), and the likeliest tokens' at its position."""

    token: str
    raw: bytes
    logprob: float
    offset: int
    top: list[tuple[str, bytes, float]]


Emit = Callable[[str, list[Spelled]], None]


class TextOut:
    def __init__(self, token_bytes: Callable[[int], bytes], stops: Sequence[str], emit: Emit):
        self._token_bytes = token_bytes
        self._decoder = TextDecoder(token_bytes)
        self._scanner = StopScanner(stops)
        self._emit = emit
        self._decoded = 0  # characters out of the decoder
        self._sent = 0  # characters emitted
        self._pending: list[Spelled] = []

    @property
    def stopped(self) -> bool:
        return self._scanner.stopped

    @property
    def stop_sequence(self) -> str | None:
        return self._scanner.stop_sequence

    def feed(self, tokens: Sequence[int], logprobs: Sequence[TokenLogprob] | None) -> None:
        for i, token in enumerate(tokens):
            piece = self._decoder.feed([token])
            if logprobs is not None and i < len(logprobs):
                self._pending.append(self._spell(logprobs[i], self._decoded))
            self._decoded += len(piece)
            self._send(self._scanner.feed(piece))

    def finish(self) -> None:
        """The generation ended without a stop sequence: the rest goes out."""
        tail = self._scanner.feed(self._decoder.flush()) + self._scanner.flush()
        self._send(tail, everything=True)

    def _send(self, text: str, everything: bool = False) -> None:
        self._sent += len(text)
        if everything:
            taken = len(self._pending)
        else:
            taken = next(
                (i for i, s in enumerate(self._pending) if s.offset >= self._sent),
                len(self._pending),
            )
        if not text and not taken:
            return
        spelled, self._pending = self._pending[:taken], self._pending[taken:]
        self._emit(text, spelled)

    def _spell(self, logprob: TokenLogprob, offset: int) -> Spelled:
        raw = self._token_bytes(logprob.token)
        top = [(self._text(t), self._token_bytes(t), lp) for t, lp in logprob.top]
        return Spelled(raw.decode("utf-8", "replace"), raw, logprob.logprob, offset, top)

    def _text(self, token: int) -> str:
        return self._token_bytes(token).decode("utf-8", "replace")
