"""The session table: which session holds which KV sequence, and who may lose theirs.

Every seq id is always in exactly one place: free, reserved by a prefill that is still
being evaluated, or held by a live session. `check()` says so and the tests call it
after every failure they provoke. A session that has a round begun (`Session.work` set)
is never released: delete, expiry and eviction all wait until its round is over.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from server.errors import ServerFull, SessionBusy, SessionNotFound
from server.protocol import SamplingParams, Strategy, VerifyResponse

log = logging.getLogger(__name__)


@dataclass
class Session:
    session_id: str
    seq_id: int
    tokens: list[int]  # committed tokens, prompt included; tokens[-1] is not yet in the KV cache
    prompt_len: int
    sampling: SamplingParams
    strategy: Strategy
    threshold: float | None
    rng: np.random.Generator  # the session's own stream: a seed makes it reproducible
    owner: str = "anonymous"  # the API key identity that opened it
    last_used: float = field(default_factory=time.monotonic)
    # The last round's request and answer: a replay of it (a client that lost the
    # response) gets the same answer and changes nothing.
    last_round_key: tuple | None = None
    last_response: VerifyResponse | None = None
    decoded_tokens: int = 0  # everything this session has evaluated, prompt included
    work: Any = None  # the round begun and not yet finished or undone (at most one)

    @property
    def n_cached(self) -> int:
        return len(self.tokens) - 1


class SessionTable:
    """Live sessions (least recently used first) and the pool of KV sequence ids."""

    def __init__(self, max_sessions: int, clear_seq: Callable[[int], None]):
        self.max_sessions = max_sessions
        self._clear_seq = clear_seq
        self._live: OrderedDict[str, Session] = OrderedDict()
        self._reserved: set[int] = set()  # prefills in progress
        self._free = list(range(max_sessions - 1, -1, -1))
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._live)

    def get(self, session_id: str, owner: str | None = None) -> Session:
        """The session, marked as just used. Another key's session answers exactly like
        a missing one: no probing for ids."""
        session = self._live.get(session_id)
        if session is None or (owner is not None and session.owner != owner):
            raise SessionNotFound(f"no session {session_id!r} (it ended, expired or was evicted)")
        self._live.move_to_end(session_id)
        session.last_used = time.monotonic()
        return session

    def find(self, session_id: str) -> Session | None:
        return self._live.get(session_id)

    def reserve(self, keep: Iterable[str] = ()) -> int:
        """A free seq id, emptied, for a new prefill. When none is free, the least recently
        used idle session is evicted: never one with a round begun or named in `keep`
        (sessions with work queued)."""
        if not self._free:
            keep = set(keep)
            victim = next(
                (s for s in self._live.values() if s.work is None and s.session_id not in keep),
                None,
            )
            if victim is None:
                raise ServerFull(
                    f"all {self.max_sessions} sessions have work in progress; retry shortly"
                )
            log.info("evicting least recently used session %s", victim.session_id)
            self.evicted += 1
            self._release(victim)
        seq_id = self._free.pop()
        self._reserved.add(seq_id)
        try:
            self._clear_seq(seq_id)
        except Exception:
            self.unreserve(seq_id)
            raise
        return seq_id

    def unreserve(self, seq_id: int) -> None:
        """A prefill that will not finish gives its sequence back, emptied."""
        self._reserved.discard(seq_id)
        try:
            self._clear_seq(seq_id)
        finally:
            self._free.append(seq_id)

    def activate(self, session: Session) -> None:
        """A prefill that finished: its reserved sequence becomes a live session."""
        self._reserved.remove(session.seq_id)
        self._live[session.session_id] = session

    def delete(self, session_id: str, owner: str | None = None) -> None:
        session = self.get(session_id, owner)
        if session.work is not None:
            # The scheduler runs a delete only after the session's queued work: reaching
            # this is a bug, and refusing keeps the round's sequence safe from reuse.
            raise SessionBusy(f"session {session_id!r} has a round in progress; retry")
        self._release(session)

    def discard(self, session_id: str) -> bool:
        """End a session if it still exists and is idle (cleanup paths); True if it did."""
        session = self._live.get(session_id)
        if session is None or session.work is not None:
            return False
        self._release(session)
        return True

    def expire(self, ttl_s: float, keep: Iterable[str] = ()) -> list[str]:
        """End idle sessions unused for `ttl_s` seconds; returns their ids."""
        keep = set(keep)
        now = time.monotonic()
        expired = [
            s
            for s in self._live.values()
            if now - s.last_used > ttl_s and s.work is None and s.session_id not in keep
        ]
        for session in expired:
            self._release(session)
        return [s.session_id for s in expired]

    def release_all(self) -> None:
        for session in list(self._live.values()):
            self._release(session)

    def check(self) -> None:
        """Every seq id is free, reserved or live, exactly once."""
        live = [s.seq_id for s in self._live.values()]
        every = sorted([*self._free, *self._reserved, *live])
        if every != list(range(self.max_sessions)):
            raise AssertionError(
                f"seq ids lost or doubled: free={sorted(self._free)} "
                f"reserved={sorted(self._reserved)} live={sorted(live)}"
            )

    def _release(self, session: Session) -> None:
        self._live.pop(session.session_id, None)
        try:
            self._clear_seq(session.seq_id)
        finally:
            self._free.append(session.seq_id)
