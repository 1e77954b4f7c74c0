"""How many tokens a round without a draft asks for, where the verifier decodes chunks of
its own tokens: paced for a watcher, or as large as it takes.

Pure: no clock (the draft lengths pass the times they measured).
"""

from __future__ import annotations

from dataclasses import dataclass

# Rounds without a draft (k = 0), watched as they come: the verifier time one asks for,
# from CHUNK_S_FIRST doubling with each such round up to CHUNK_S_LAST (the link's share
# small, the stream still a few updates a second), and at least CHUNK_LINKS times the
# link's time.
CHUNK_S_FIRST = 0.1
CHUNK_S_LAST = 0.4
CHUNK_LINKS = 4
CHUNK_FIRST = 4  # while the verifier's time per token is not known


@dataclass
class ChunkPace:
    """The tokens a round without a draft asks for, where the verifier decodes chunks of
    its own (`max_chunk` > 1).

    Watched (a stream, a terminal, stop sequences looked for in the text), the first round
    of a generation asks for one token, so that it shows as soon as the verifier alone
    would show it; later ones ask for CHUNK_S_FIRST of the verifier's time, doubling each
    chunk up to CHUNK_S_LAST, and at least CHUNK_LINKS link times. Unwatched, a chunk is
    as large as the verifier takes (the loop caps it by the tokens still wanted): the
    fewest rounds, each of which costs a round trip and the verifier's turn-around."""

    max_chunk: int = 1
    watched: bool = True
    _seconds: float | None = None  # None: no round answered yet, the first token is due
    # Measured from rounds of one row, for `measured_size`: the verifier's time a token
    # of a chunk, and the link's (a single step's round trip less the verifier's time).
    step_s: float | None = None
    link_s: float | None = None

    def observe(self, rows: int, verifier_s: float, round_trip_s: float, steps: int) -> None:
        """A round answered: its rows, the verifier's time for it, its round trip, and
        its steps (a chunk's tokens, one pass each)."""
        if rows != 1 or verifier_s <= 0:
            return
        step = verifier_s / max(steps, 1)
        self.step_s = step if self.step_s is None else 0.5 * (self.step_s + step)
        if steps == 1:  # a chunk's round trip holds its steps' waits too
            link = max(0.0, round_trip_s - verifier_s)
            self.link_s = link if self.link_s is None else 0.5 * (self.link_s + link)

    def measured_size(self, paced: bool = False) -> int:
        """`size` at the times `observe` measured."""
        return self.size(self.step_s or 0.0, self.link_s or 0.0, paced)

    def size(self, per_token_s: float, link_s: float, paced: bool = False) -> int:
        """`paced`: as if watched (a round held back while the draft model gets ready:
        the drafted round is to follow soon after it)."""
        if self.max_chunk <= 1:
            return 1
        if not (self.watched or paced):
            return self.max_chunk
        if self._seconds is None:
            return 1
        if per_token_s <= 0:
            return min(self.max_chunk, CHUNK_FIRST)
        seconds = max(self._seconds, CHUNK_LINKS * link_s)
        return max(1, min(self.max_chunk, round(seconds / per_token_s)))

    def answered(self, chunk: bool) -> None:
        """A round was answered (`chunk`: one without a draft)."""
        if self._seconds is None:
            self._seconds = CHUNK_S_FIRST
        elif chunk:
            self._seconds = min(2 * self._seconds, CHUNK_S_LAST)

    def restart(self) -> None:
        """Chunks again after drafted rounds: from the shortest (the first token is out,
        so not one token)."""
        if self._seconds is not None:
            self._seconds = CHUNK_S_FIRST
