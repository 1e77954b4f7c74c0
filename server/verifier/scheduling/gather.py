"""When the engine thread starts a pass of rounds: now, or a moment later, together with
the sessions the last pass answered.

Drafters that come back quickly fall into step with the passes: rounds that arrive while
a pass runs wait for the next one, and the sessions that pass answers come back while
the next one runs. The drafters split into groups that take turns, and each pass pays a
pass's fixed cost (every weight read once, the kernels launched once) for one group.
Holding the queued rounds until the sessions just answered are back, when they have been
coming back faster than that fixed cost, puts the groups into one pass again.

The hold is bounded by the fixed cost of the last pass of rounds (its time, times the
probe's pass cost in rows over that plus its rows; with pinned shapes, where every pass
computes every sequence, the whole pass), counted from when those sessions were
answered. Only sessions whose recent returns (answer to next round) took less than a
whole pass are waited for: those are the ones that would have been in the very next
pass anyway, and drafters across a real link, whose round trip exceeds a pass, never
are. A return is measured while the next pass runs, which can slow it (on a CPU the
event loop shares the cores with the pass), so it is not compared with the hold's bound
itself; instead a session that misses a hold it was waited for in is not waited for
during its next 2, then 4, 8, ... answers, and only a run of holds made in a row earns
one miss back. Whatever clients do (come back late on purpose, just inside the bound,
or not at all), holds never take more than `HOLD_SHARE` of the time the engine spends
decoding, counted over its recent passes: gathering can cost everyone at most that.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

SessionKey = tuple[str, str]  # (API key, session id)

GAP_WEIGHT = 0.5  # weight of the newest return in a session's running mean
RETURN_SLACK = 2.0  # a session is expected back within this many of its mean returns
MAX_SKIPPED = 64  # most answers a session that keeps missing holds goes unwaited for
FORGIVE_AFTER = 8  # holds made in a row that earn one miss back
MAX_MISSES = 6  # 2**6 = MAX_SKIPPED
HOLD_SHARE = 0.2  # most time holds take, as a share of the time spent decoding
RECENT = 0.95  # each pass, the weight left to what came before it (about 20 passes)
FORGET_AFTER_S = 60.0  # a session neither answered nor back for this long is forgotten


@dataclass(slots=True)
class _Session:
    seen_at: float  # its last answer or arrival
    answered_at: float | None = None  # answered, and its next round not here yet
    return_s: float | None = None  # running mean of answer to next round
    misses: int = 0  # holds it missed, less those earned back
    made: int = 0  # holds it made since its last miss or its last miss earned back
    skip: int = 0  # its answers still to go before it is waited for again


class Gatherer:
    """What the scheduler tells it: passes of rounds (`observe_pass`), which sessions a
    cycle answered (`answered`), rounds arriving (`arrived`); what it answers: until
    when to hold the rounds queued now (`deadline`). Any thread."""

    def __init__(
        self,
        pass_cost_rows: float,
        pinned: bool,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.clock = clock
        self._pass_cost_rows = pass_cost_rows
        self._pinned = pinned
        self._lock = threading.Lock()
        self.fixed_s = 0.0  # the last pass of rounds' fixed cost, in seconds
        self.pass_s = 0.0  # the last pass of rounds' time
        self._decode_s = 0.0  # time decoding, recent passes weighted more
        self._hold_s = 0.0  # time holding, on the same weights
        self._sessions: dict[SessionKey, _Session] = {}
        self._expected: set[SessionKey] = set()  # those the last cycle of rounds answered

    def observe_pass(self, kind: str, rows: int, seconds: float) -> None:
        with self._lock:
            self._decode_s = self._decode_s * RECENT + seconds
            self._hold_s *= RECENT
        if kind != "rounds":
            return
        if self._pinned:
            fixed = seconds
        else:
            fixed = seconds * self._pass_cost_rows / (self._pass_cost_rows + rows)
        self.fixed_s, self.pass_s = fixed, seconds

    def answered(self, keys: Iterable[SessionKey]) -> None:
        now = self.clock()
        with self._lock:
            self._expected = set(keys)
            for key in self._expected:
                session = self._sessions.setdefault(key, _Session(now))
                session.seen_at = session.answered_at = now
                session.skip = max(0, session.skip - 1)
            stale = [k for k, s in self._sessions.items() if now - s.seen_at > FORGET_AFTER_S]
            for key in stale:  # ended, or gone quiet: tracked afresh if it comes back
                del self._sessions[key]

    def arrived(self, key: SessionKey) -> None:
        now = self.clock()
        with self._lock:
            session = self._sessions.get(key)
            waited = key in self._expected and session is not None and self._eligible(session)
            self._expected.discard(key)
            if session is None or session.answered_at is None:
                return
            took = now - session.answered_at
            if waited and took <= self.fixed_s:
                session.made += 1  # back within a hold's bound
                if session.made >= FORGIVE_AFTER:
                    session.misses, session.made = max(0, session.misses - 1), 0
            mean = session.return_s
            session.return_s = took if mean is None else mean + GAP_WEIGHT * (took - mean)
            session.seen_at, session.answered_at = now, None

    def not_coming(self, key: SessionKey) -> None:
        """The session's next round is not coming soon (it is being deleted, finished or
        read from): not waited for after this answer."""
        with self._lock:
            self._expected.discard(key)

    def held(self, seconds: float) -> None:
        with self._lock:
            self._hold_s += seconds

    def waited_for(self, key: SessionKey) -> bool:
        """Whether the session, answered now, would be waited for."""
        with self._lock:
            session = self._sessions.get(key)
            return session is not None and self._eligible(session)

    def _eligible(self, session: _Session) -> bool:
        mean = session.return_s
        return session.skip == 0 and mean is not None and mean <= self.pass_s

    def deadline(self) -> float | None:
        """Until when (this object's clock) to hold the rounds queued now, for sessions
        the last cycle answered that are not back yet; None: run them now."""
        with self._lock:
            fixed = self.fixed_s
            if self._hold_s >= HOLD_SHARE * self._decode_s:
                return None
            awaited = [
                (session.answered_at, session.return_s)
                for session in map(self._sessions.get, self._expected)
                if session is not None
                and session.answered_at is not None
                and session.return_s is not None
                and self._eligible(session)
            ]
        if not awaited or fixed <= 0:
            return None
        due = max(at + RETURN_SLACK * mean for at, mean in awaited)
        return min(due, min(at for at, _ in awaited) + fixed)

    def hold(self, wake: threading.Condition, waiting: Callable[[], bool]) -> float | None:
        """Wait on `wake` (held by the caller; whoever queues a round notifies it) while
        `waiting()` and the deadline has not passed; the seconds held, None if it did not
        hold."""
        began = time.perf_counter()
        held = False
        while waiting():
            deadline = self.deadline()
            if deadline is None:
                break
            left = deadline - self.clock()
            if left <= 0:
                self.gave_up(held)
                break
            held = True
            wake.wait(timeout=left)
        if not held:
            return None
        seconds = time.perf_counter() - began
        self.held(seconds)
        return seconds

    def gave_up(self, held: bool) -> list[SessionKey]:
        """The deadline passed with these sessions not back. If a hold waited for them
        (`held`), those it waited for in vain sit out their next 2, 4, 8, ... answers
        (doubling with each miss not yet earned back); either way none is waited for
        again until answered again. The sessions that sit out."""
        with self._lock:
            missed = []
            for key in sorted(self._expected):
                session = self._sessions.get(key)
                if held and session is not None and self._eligible(session):
                    session.misses = min(session.misses + 1, MAX_MISSES)
                    session.made = 0
                    session.skip = min(2**session.misses, MAX_SKIPPED)
                    missed.append(key)
            self._expected.clear()
        return missed
