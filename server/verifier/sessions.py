"""The session table: which session holds which KV sequence, and who may lose theirs.

Every seq id is always in exactly one place: free (empty), reserved by a prefill that is
still being evaluated, held by a live session, or holding a cached prefix. `check()` says
so and the tests call it after every failure they provoke. A session that has a round
begun (`Session.work` set) is never released: delete, expiry and eviction all wait until
its round is over.

Prompt reuse: a session that ends (DELETE, expiry, the end of a /generate) leaves its
KV sequence and tokens behind as a cached prefix, until the slot is needed or its TTL
ends. A new prompt of the same API key takes the cached prefix with which it shares the
longest common prefix (tokens compared one by one, never hashed), trimmed to that, and
evaluates only the rest. Prefixes are never shared across keys: a shared cache leaks
prompts through timing.

Shares: each API key (owner) may hold `key_share` sequences (sessions, cached prefixes
and prompts being evaluated together; by default an equal part of all of them among the
keys holding any, and the one asking). A key may go past its share while sequences are
free. When none is
free, the sequence for a new prompt is taken, least recently used first, from: a cached
prefix of a key over its share, one of the asking key's own prefixes, an idle session of
a key over its share, one of the asking key's own idle sessions; never from a key within
its share. So one key opening sessions by the hundred takes only from itself.

Packing: llama.cpp runs sequences in one forward pass only when their ids rise by one,
so a gap among the sessions' ids costs a pass. Given `copy(src, dst)`, a new session, or
a reused prefix, goes where it adds the fewest runs of neighbouring ids to those that
sessions and prompts hold (beside them), preferring what needs fewer copies: a free id,
then the id of a cached prefix, which moves to a free id away from the sessions. A copy
costs one sequence's KV buffers, far less than evaluating a prompt; nothing moves when
that gains no run, when no id is free, or a live session.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from server.shared.prefix import common_prefix_len
from server.shared.protocol import SamplingParams, Strategy, VerifyResponse
from server.verifier.errors import ServerFull, SessionBusy, SessionExists, SessionNotFound

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


@dataclass(frozen=True)
class CachedPrefix:
    owner: str
    tokens: list[int]  # exactly what the sequence's KV cells hold, in position order
    cached_at: float = field(default_factory=time.monotonic)


class SessionTable:
    """Live sessions (least recently used first), cached prefixes (least recently cached
    first) and the pool of KV sequence ids.

    `remove(seq_id, p0)` drops a sequence's cells from position p0 on (-1: all of them);
    `copy(src, dst)`, if given, makes dst hold what src holds (sequences are packed).
    With `min_reuse` = 0 no prefix is kept; `key_share` = 0: an equal share."""

    def __init__(
        self,
        max_sessions: int,
        remove: Callable[[int, int], None],
        *,
        copy: Callable[[int, int], None] | None = None,
        min_reuse: int = 0,
        key_share: int = 0,
    ):
        self.max_sessions = max_sessions
        self._remove = remove
        self._copy = copy
        self.min_reuse = min_reuse
        self.key_share = key_share
        self._live: OrderedDict[str, Session] = OrderedDict()
        self._reserved: dict[int, str] = {}  # prefills in progress: seq id -> owner
        self._opening: dict[int, str] = {}  # their session ids, by seq id
        self._cached: OrderedDict[int, CachedPrefix] = OrderedDict()
        self._free = list(range(max_sessions - 1, -1, -1))
        self.evicted = 0
        self.dropped_prefixes = 0
        self.moved = 0  # sequences copied to another id by packing

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

    # -- shares ------------------------------------------------------------------------

    def held(self) -> Counter[str]:
        """Sequences each key holds: live sessions, cached prefixes, prompts in progress."""
        held: Counter[str] = Counter(s.owner for s in self._live.values())
        held.update(prefix.owner for prefix in self._cached.values())
        held.update(self._reserved.values())
        return held

    def share(self, asking: str | None = None) -> float:
        """A key's share: `key_share`, or an equal part of the sequences among the keys
        that hold any (and the one asking)."""
        if self.key_share:
            return self.key_share
        keys = set(self.held()) | ({asking} if asking else set())
        return self.max_sessions / max(1, len(keys))

    # -- taking a sequence -------------------------------------------------------------

    def reserve(
        self, keep: Iterable[str] = (), owner: str = "anonymous", prompt: Sequence[int] = ()
    ) -> tuple[int, int]:
        """A seq id for a new prefill of `prompt`, and how many of its first tokens the
        sequence already holds: the longest cached prefix of `owner`'s, if at least
        `min_reuse` tokens long (never the prompt's last token: that one is evaluated with
        the first round). Otherwise an empty sequence, made free as the module says when
        none is: never from a session with a round begun or named in `keep` (sessions
        with work queued)."""
        reused = self._take_prefix(owner, prompt)
        if reused is not None:
            seq_id, n = reused
            return self._place(seq_id), n
        if not self._free:
            self._make_room(owner, set(keep))
        seq_id = self._place()
        self._free.remove(seq_id)
        self._reserved[seq_id] = owner
        try:
            self._remove(seq_id, -1)
        except Exception:
            self.unreserve(seq_id)
            raise
        return seq_id, 0

    def _make_room(self, owner: str, keep: set[str]) -> None:
        """Free one sequence, as the module says: from the keys over their share, the
        furthest over first (the asking key counts the one it asks for), then from the
        asking key itself; a cached prefix first, else an idle session."""
        held, share = self.held(), self.share(owner)
        held[owner] += 1
        over = sorted(
            (key for key, n in held.items() if n > share),
            key=lambda key: (held[key] - share, key != owner),
            reverse=True,
        )
        givers = over if owner in over else [*over, owner]
        for key in givers:
            for seq_id, prefix in self._cached.items():
                if prefix.owner == key:
                    del self._cached[seq_id]
                    self.dropped_prefixes += 1
                    self._free_seq(seq_id)
                    return
        for key in givers:
            for session in self._live.values():
                if session.owner == key and session.work is None and session.session_id not in keep:
                    log.info("evicting the least recently used idle session of a key")
                    self.evicted += 1
                    self._release(session)
                    return
        if held[owner] > share:
            raise ServerFull(
                f"this API key holds its share of the {self.max_sessions} sessions, each "
                "with a round in progress; retry shortly"
            )
        raise ServerFull(
            f"all {self.max_sessions} sessions are busy or held by keys within their share; "
            "retry shortly"
        )

    # -- packing -----------------------------------------------------------------------

    def _place(self, reused: int | None = None) -> int:
        """The id a new sequence takes. `reused`: a reused prefix, reserved at that id;
        None: an empty sequence, which takes a free id (one must be). Without `copy`, the
        lowest free id or the prefix's own. With it, the id where it adds the fewest runs
        of neighbouring held ids (a run's rounds make one pass), then the one fewest
        copies away, then the lowest; a prefix cached there first moves to a free id."""
        if self._copy is None:
            return min(self._free) if reused is None else reused
        held = {s.seq_id for s in self._live.values()} | set(self._reserved)
        held.discard(reused)

        def runs_added(seq_id: int, held: set[int] = held) -> int:
            return 1 - (seq_id - 1 in held) - (seq_id + 1 in held)

        moves = 0 if reused is None else 1
        candidates = [(runs_added(s), moves, s) for s in self._free]
        if self._free:  # a prefix in the way needs a free id to go to
            candidates += [(runs_added(s), moves + 1, s) for s in self._cached]
        if reused is not None:
            candidates.append((runs_added(reused), 0, reused))
        _, _, target = min(candidates)
        if target in self._cached and not self._move_prefix_away(target, held | {target}):
            _, _, target = min(c for c in candidates if c[2] not in self._cached)
        if target == reused or reused is None:
            return target
        try:
            self._copy(reused, target)
        except Exception:
            log.exception("could not move a reused prefix; it stays where it is")
            return reused
        self._free.remove(target)
        self._reserved[target] = self._reserved.pop(reused)
        self._moved_from(reused)
        return target

    def _move_prefix_away(self, seq_id: int, held: set[int]) -> bool:
        """Move the prefix cached at `seq_id` to the free id furthest from `held` (the
        highest of those beside none); True when `seq_id` is free after."""
        spare = max(self._free, key=lambda s: ((s - 1 in held) + (s + 1 in held) == 0, s))
        try:
            self._copy(seq_id, spare)
        except Exception:
            log.exception("could not move a cached prefix; the new sequence goes elsewhere")
            return False
        self._free.remove(spare)
        self._cached = OrderedDict(  # the same order: least recently cached first
            (spare if s == seq_id else s, prefix) for s, prefix in self._cached.items()
        )
        self._moved_from(seq_id)
        return True

    def _moved_from(self, seq_id: int) -> None:
        """Count a move; the sequence moved away from is free, even if its cells could not
        be removed: whoever takes it empties it first (reserve removes, a copy replaces)."""
        self.moved += 1
        try:
            self._free_seq(seq_id)
        except Exception:
            log.exception("could not empty a sequence moved away from; emptied when taken")

    def _take_prefix(self, owner: str, prompt: Sequence[int]) -> tuple[int, int] | None:
        if not self.min_reuse or len(prompt) < 2:
            return None
        best_seq, best_len = None, 0
        for seq_id, prefix in self._cached.items():
            if prefix.owner == owner:
                n = common_prefix_len(prefix.tokens, prompt)
                if n > best_len:
                    best_seq, best_len = seq_id, n
        best_len = min(best_len, len(prompt) - 1)
        if best_seq is None or best_len < self.min_reuse:
            return None
        del self._cached[best_seq]
        self._reserved[best_seq] = owner
        try:
            self._remove(best_seq, best_len)  # what differs from the prompt goes
        except Exception:
            log.exception("could not trim a cached prefix; evaluating the prompt whole")
            del self._reserved[best_seq]
            self._free.append(best_seq)  # emptied by whoever reserves it next
            return None
        return best_seq, best_len

    def check_new_id(self, session_id: str) -> None:
        """Refused (SessionExists) when a live session or another prefill has this id,
        whoever owns it: ids are a client's random choice, so a clash is a retry of its
        own prefill, or a mistake."""
        if session_id in self._live or session_id in self._opening.values():
            raise SessionExists(f"session {session_id!r} exists already")

    def claim(self, seq_id: int, session_id: str) -> None:
        """The id a reserved sequence's session will have (checked by check_new_id)."""
        self._opening[seq_id] = session_id

    def unreserve(self, seq_id: int) -> None:
        """A prefill that will not finish gives its sequence back, emptied."""
        self._opening.pop(seq_id, None)
        self._reserved.pop(seq_id, None)
        self._free_seq(seq_id)

    def activate(self, session: Session) -> None:
        """A prefill that finished: its reserved sequence becomes a live session."""
        del self._reserved[session.seq_id]
        self._opening.pop(session.seq_id, None)
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
        if (
            session is None
            or session.work is not None
            or (only is not None and session is not only)
        ):
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
        for seq_id, prefix in list(self._cached.items()):
            if now - prefix.cached_at > prefix_ttl_s:
                del self._cached[seq_id]
                self._free_seq(seq_id)
        return [s.session_id for s in expired]

    def release_all(self) -> None:
        for session in list(self._live.values()):
            self._release(session)
        for seq_id in list(self._cached):
            del self._cached[seq_id]
            self._free_seq(seq_id)

    @property
    def cached_prefixes(self) -> dict[int, CachedPrefix]:
        return dict(self._cached)

    @property
    def reserved(self) -> dict[int, str]:
        return dict(self._reserved)

    def check(self) -> None:
        """Every seq id is free, reserved, live or caching a prefix, exactly once, and
        every key's count adds up."""
        live = [s.seq_id for s in self._live.values()]
        every = sorted([*self._free, *self._reserved, *live, *self._cached])
        if every != list(range(self.max_sessions)):
            raise AssertionError(
                f"seq ids lost or doubled: free={sorted(self._free)} "
                f"reserved={sorted(self._reserved)} live={sorted(live)} "
                f"cached={sorted(self._cached)}"
            )
        opening = list(self._opening.values())
        if (
            set(self._opening) != set(self._reserved)
            or len(set(opening)) != len(opening)
            or any(session_id in self._live for session_id in opening)
        ):
            raise AssertionError(f"opening ids {self._opening} against reserved {self._reserved}")
        if sum(self.held().values()) != self.max_sessions - len(self._free):
            raise AssertionError(f"per-key counts {dict(self.held())} do not add up")

    def _release(self, session: Session, keep_prefix: bool = False) -> None:
        self._live.pop(session.session_id, None)
        if keep_prefix and self.min_reuse and session.n_cached >= self.min_reuse:
            # The cells hold exactly tokens[:-1]: the pending token was never evaluated.
            self._cached[session.seq_id] = CachedPrefix(session.owner, session.tokens[:-1])
            return
        self._free_seq(session.seq_id)

    def _free_seq(self, seq_id: int) -> None:
        try:
            self._remove(seq_id, -1)
        finally:
            self._free.append(seq_id)
