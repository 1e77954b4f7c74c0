"""Stop sequences over streamed text: emit what is safe, hold back a possible stop start."""

from __future__ import annotations


class StopScanner:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text that can go out now; sets `stopped` when a stop sequence appeared."""
        if self.stopped:
            return ""
        self._pending += text
        hits = [i for i in (self._pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self._pending = self._pending[: min(hits)], ""
            return out
        hold = max(
            (n for s in self.stops for n in range(1, len(s)) if self._pending.endswith(s[:n])),
            default=0,
        )
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out
