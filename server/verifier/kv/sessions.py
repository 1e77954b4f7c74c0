"""The session table: which session holds which KV sequence.

Every seq id is always in exactly one place: free (empty), reserved by a prefill that is
still being evaluated, held by a live session, or holding a cached prefix (tests check
this after every failure they provoke: tests/fixtures/invariants.py). A session that has
a round begun (`Session.work` set) is never released: delete, expiry and eviction all
wait until its round is over.

Three policies decide for the table: which cached prefix a prompt reuses
(prefix_reuse.py), whose sequence is taken when none is free (eviction.py), and which id
a new sequence takes (packing.py).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from server.shared.draft_gain import Acceptance
from server.shared.protocol import SamplingParams, Strategy, VerifyResponse
from server.shared.sampling import PositionDraws
from server.verifier.decoding.copy_draft import COPY_PRIOR, RESYNC_PRIOR
from server.verifier.errors import ServerFull, SessionBusy, SessionExists, SessionNotFound
from server.verifier.kv.eviction import Eviction
from server.verifier.kv.packing import Packing
from server.verifier.kv.prefix_reuse import CachedPrefix, PrefixReuse
from server.verifier.kv.prompt_cuts import Tiling, clip
from server.verifier.kv.sequence_ids import SequenceIds

if TYPE_CHECKING:
    from server.shared.constraint import Constraint
    from server.verifier.decoding.checks import RoundKey
    from server.verifier.decoding.jobs import VerifyWork

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
    draws: PositionDraws  # its random numbers, by position: a seed makes them reproducible
    owner: str = "anonymous"  # the API key identity that opened it
    cache_scope: str = ""  # whose prefixes it reuses within the key (a proxy's client's)
    last_used: float = field(default_factory=time.monotonic)
    # The last round's request and answer: a replay of it (a client that lost the
    # response) gets the same answer and changes nothing.
    last_round_key: RoundKey | None = None
    last_response: VerifyResponse | None = None
    decoded_tokens: int = 0  # everything this session has evaluated, prompt included
    tiling: Tiling = ()  # which of its cells were written in tiled passes (prompt_cuts.py)
    acceptance: Acceptance = field(default_factory=Acceptance)  # of its drafts, so far
    copies: Acceptance = COPY_PRIOR  # of the verifier's own copies in its chunks (copy_draft.py)
    copy_anchor: tuple[int, int] | None = None  # (source index, position) a copy broke off at
    resyncs: Acceptance = RESYNC_PRIOR  # of its copies that went on after an edit
    last_draft: int = 0  # its last drafted round's length (rounds without a draft keep it)
    logprobs: int | None = None  # with each committed token, its logprob and this many top
    constraint: Constraint | None = None  # the grammar's state at the committed tokens
    work: VerifyWork | None = None  # the round begun and not yet finished or undone (at most one)

    @property
    def n_cached(self) -> int:
        return len(self.tokens) - 1


@dataclass(frozen=True)
class Reservation:
    """A sequence reserved for a new prompt: `reused` of the prompt's first tokens are
    in it already; `evicted` an idle session to make room; `moved` sequences to another
    id on the way (packing)."""

    seq_id: int
    reused: int = 0
    evicted: bool = False
    moved: int = 0


class SessionTable:
    """Live sessions (least recently used first), cached prefixes (least recently cached
    first) and the pool of KV sequence ids.

    `remove(seq_id, p0)` drops a sequence's cells from position p0 on (-1: all of them);
    `copy(src, dst)` makes dst hold what src holds (used when `packing` moves one)."""

    def __init__(
        self,
        max_sessions: int,
        remove: Callable[[int, int], None],
        *,
        copy: Callable[[int, int], None],
        packing: Packing,
        eviction: Eviction,
        prefix_reuse: PrefixReuse,
    ):
        self.max_sessions = max_sessions
        self.ids = SequenceIds(max_sessions, remove, copy)
        self.packing = packing
        self.eviction = eviction
        self.prefix_reuse = prefix_reuse
        self._live: OrderedDict[str, Session] = OrderedDict()
        # Prefills in progress: seq id -> (owner, the id their session will have).
        self._reserved: dict[int, tuple[str, str]] = {}

    def __len__(self) -> int:
        return len(self._live)

    def sessions(self) -> Iterator[Session]:
        return iter(list(self._live.values()))

    def get(self, session_id: str, owner: str | None = None) -> Session:
        """The session, marked as just used. Another key's session answers exactly like
        a missing one: no probing for ids."""
        session = self._live.get(session_id)
        if session is None or (owner is not None and session.owner != owner):
            raise SessionNotFound(f"no session {session_id!r} (it ended, expired or was evicted)")
        self._live.move_to_end(session_id)
        session.last_used = time.monotonic()
        return session

    def held(self) -> Counter[str]:
        """Sequences each key holds: live sessions, cached prefixes, prompts in progress."""
        held: Counter[str] = Counter(s.owner for s in self._live.values())
        held.update(prefix.owner for _, prefix in self.prefix_reuse.items())
        held.update(owner for owner, _ in self._reserved.values())
        return held

    # -- taking a sequence -------------------------------------------------------------

    def reserve(
        self, session_id: str, owner: str, prompt: Sequence[int], keep: Iterable[str] = (),
        tiling: Tiling = (), scope: str = "",
    ) -> Reservation:  # fmt: skip
        """A sequence for the prefill of session `session_id` (checked by check_new_id):
        the prefix cache's choice among `owner`'s of cache `scope`, trimmed to what it
        shares with `prompt` (and to the cells the prompt's own evaluation, tiled as
        `tiling` says, would write), or an empty one, made free by the eviction policy
        when none is: never from a session with a round begun or named in `keep`
        (sessions with work queued)."""
        reused = self._take_prefix(owner, prompt, session_id, tiling, scope)
        if reused is not None:
            seq_id, moved = self._place(reused[0])
            return Reservation(seq_id, reused[1], moved=moved)
        evicted = not self.ids.free and self._make_room(owner, set(keep))
        seq_id, moved = self._place()
        self.ids.take(seq_id)
        self._reserved[seq_id] = owner, session_id
        try:
            self.ids.remove(seq_id, -1)
        except Exception:
            self.unreserve(seq_id)
            raise
        return Reservation(seq_id, 0, evicted, moved)

    def _make_room(self, owner: str, keep: set[str]) -> bool:
        """Free one sequence as the eviction policy says; True when it took a session
        (False: a cached prefix)."""
        held = self.held()
        idle = [
            (s.session_id, s.owner)
            for s in self._live.values()
            if s.work is None and s.session_id not in keep
        ]
        prefixes = [(seq_id, prefix.owner) for seq_id, prefix in self.prefix_reuse.items()]
        chosen = self.eviction.choose(held, owner, prefixes, idle)
        if chosen is None:
            raise ServerFull(self.eviction.refusal(held, owner))
        if chosen[0] == "prefix":
            self.drop_prefix(chosen[1])
            return False
        log.info("evicting the least recently used idle session of a key")
        self._release(self._live[chosen[1]])
        return True

    def _place(self, reused: int | None = None) -> tuple[int, int]:
        """The id a new sequence takes, as packing says, and how many sequences moved.
        `reused`: a reused prefix, reserved at that id; None: an empty sequence, which
        takes a free id (one must be). A prefix cached at the chosen id first moves to a
        free id; a move that fails leaves things where they are."""
        held = {s.seq_id for s in self._live.values()} | set(self._reserved)
        held.discard(reused)
        cached = self.prefix_reuse
        places = self.packing.places(self.ids.free, list(cached), held, reused)
        target, moved = places[0], 0
        if target in cached:
            if self._move_prefix_away(target, held | {target}):
                moved = 1
            else:
                target = next(s for s in places if s not in cached)
        if target == reused or reused is None:
            return target, moved
        try:
            self.ids.copy(reused, target)
        except Exception:
            log.exception("could not move a reused prefix; it stays where it is")
            return reused, moved
        self.ids.take(target)
        self._reserved[target] = self._reserved.pop(reused)
        self.ids.release_quietly(reused)  # whoever takes it next empties it first
        return target, moved + 1

    def _move_prefix_away(self, seq_id: int, held: set[int]) -> bool:
        """Move the prefix cached at `seq_id` to packing's spare free id; True when
        `seq_id` is free after."""
        spare = self.packing.spare(self.ids.free, held)
        try:
            self.ids.copy(seq_id, spare)
        except Exception:
            log.exception("could not move a cached prefix; the new sequence goes elsewhere")
            return False
        self.ids.take(spare)
        self.prefix_reuse.relocate(seq_id, spare)
        self.ids.release_quietly(seq_id)
        return True

    def _take_prefix(
        self, owner: str, prompt: Sequence[int], session_id: str, tiling: Tiling, scope: str
    ) -> tuple[int, int] | None:
        chosen = self.prefix_reuse.take(owner, prompt, tiling, scope)
        if chosen is None:
            return None
        seq_id, n = chosen
        self._reserved[seq_id] = owner, session_id
        try:
            self.ids.remove(seq_id, n)  # what differs from the prompt goes
        except Exception:
            log.exception("could not trim a cached prefix; evaluating the prompt whole")
            del self._reserved[seq_id]
            self.ids.release_quietly(seq_id)
            return None
        return chosen

    def check_new_id(self, session_id: str) -> None:
        """Refused (SessionExists) when a live session or another prefill has this id,
        whoever owns it: ids are a client's random choice, so a clash is a retry of its
        own prefill, or a mistake."""
        if session_id in self._live or session_id in self.opening.values():
            raise SessionExists(f"session {session_id!r} exists already")

    def unreserve(self, seq_id: int) -> None:
        """A prefill that will not finish gives its sequence back, emptied."""
        self._reserved.pop(seq_id, None)
        self.ids.release(seq_id)

    def activate(self, session: Session) -> None:
        """A prefill that finished: its reserved sequence becomes a live session."""
        del self._reserved[session.seq_id]
        self._live[session.session_id] = session

    # -- ending sessions ---------------------------------------------------------------

    def delete(self, session_id: str, owner: str | None = None) -> None:
        session = self.get(session_id, owner)
        if session.work is not None:
            # The scheduler runs a delete only after the session's queued work: reaching
            # this is a bug, and refusing keeps the round's sequence safe from reuse.
            raise SessionBusy(f"session {session_id!r} has a round in progress; retry")
        self._release(session, keep_prefix=True)

    def discard(
        self, session_id: str, keep_prefix: bool = True, only: object | None = None
    ) -> bool:
        """End a session if it still exists and is idle (cleanup paths); True if it did.
        `keep_prefix=False` when its cells may not match its tokens; `only`: end it only if
        it is that very session (not another opened since under the same id)."""
        session = self._live.get(session_id)
        if session is None or session.work is not None:
            return False
        if only is not None and session is not only:
            return False
        self._release(session, keep_prefix=keep_prefix)
        return True

    def expire(self, ttl_s: float, prefix_ttl_s: float, keep: Iterable[str] = ()) -> list[str]:
        """End idle sessions unused for `ttl_s` seconds, and drop prefixes cached for
        `prefix_ttl_s`; returns the sessions' ids."""
        keep = set(keep)
        now = time.monotonic()
        expired = [
            s
            for s in self._live.values()
            if now - s.last_used > ttl_s and s.work is None and s.session_id not in keep
        ]
        for session in expired:
            self._release(session, keep_prefix=True)
        for seq_id in self.prefix_reuse.older_than(prefix_ttl_s, now):
            self.drop_prefix(seq_id)
        return [s.session_id for s in expired]

    def release_all(self) -> None:
        for session in list(self._live.values()):
            self._release(session)
        for seq_id in self.prefix_reuse:
            self.drop_prefix(seq_id)

    @property
    def cached_prefixes(self) -> dict[int, CachedPrefix]:
        return dict(self.prefix_reuse.items())

    @property
    def reserved(self) -> dict[int, str]:
        return {seq_id: owner for seq_id, (owner, _) in self._reserved.items()}

    @property
    def free(self) -> list[int]:
        return self.ids.free

    @property
    def opening(self) -> dict[int, str]:
        return {seq_id: session_id for seq_id, (_, session_id) in self._reserved.items()}

    def _release(self, session: Session, keep_prefix: bool = False) -> None:
        self._live.pop(session.session_id, None)
        if keep_prefix and self.prefix_reuse.keeps(session.n_cached):
            # The cells hold exactly tokens[:-1]: the pending token was never evaluated.
            cells = session.tokens[:-1]
            tiling = clip(session.tiling, len(cells))
            prefix = CachedPrefix(session.owner, cells, tiling=tiling, scope=session.cache_scope)
            self.prefix_reuse.keep(session.seq_id, prefix)
            return
        self.ids.release(session.seq_id)

    def drop_prefix(self, seq_id: int) -> None:
        self.prefix_reuse.pop(seq_id)
        self.ids.release(seq_id)
