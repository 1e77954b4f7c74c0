"""Stop sequences over streamed text: emit what is safe, hold back a possible stop start.

Each stop sequence has a Knuth-Morris-Pratt automaton that follows the text character by
character, so scanning costs time linear in the text generated whatever the stops' length,
and what is held back is exactly the longest tail of the text that could still begin a
stop. Generation stops where a stop sequence is first complete (OpenAI's rule: the text
ends before it).
"""

from __future__ import annotations

from collections.abc import Sequence


def _failure(pattern: str) -> list[int]:
    """KMP's failure function: for each prefix, the length of its longest proper border."""
    border = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = border[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        border[i] = k
    return border


class StopScanner:
    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._borders = [_failure(s) for s in self.stops]
        self._matched = [0] * len(self.stops)  # per stop: its prefix the text ends with
        self._held = ""
        self.stopped = False
        self.stop_sequence: str | None = None  # the one that stopped the text

    def feed(self, text: str) -> str:
        """Text that can go out now; sets `stopped` when a stop sequence appeared."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        pending = self._held + text
        offset = len(self._held)
        for i, char in enumerate(text):
            ended = 0  # the longest stop complete at this character (the earliest start)
            ending = None
            for j, stop in enumerate(self.stops):
                k = self._matched[j]
                while k and stop[k] != char:
                    k = self._borders[j][k - 1]
                if stop[k] == char:
                    k += 1
                if k == len(stop):
                    if k > ended:
                        ended, ending = k, stop
                    k = self._borders[j][k - 1]
                self._matched[j] = k
            if ended:
                self.stopped, self.stop_sequence, self._held = True, ending, ""
                return pending[: offset + i + 1 - ended]
        hold = max(self._matched)
        cut = len(pending) - hold
        out, self._held = pending[:cut], pending[cut:]
        return out

    def flush(self) -> str:
        out, self._held = ("" if self.stopped else self._held), ""
        return out
