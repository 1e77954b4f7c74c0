"""Eviction: whose sequence is taken when a new prompt finds none free.

Each API key (owner) may hold `key_share` sequences (sessions, cached prefixes and
prompts being evaluated together); by default an equal part of all of them among the keys
holding any, and the one asking. A key may go past its share while sequences are free.
When none is free, the sequence is taken, least recently used first, from: a cached
prefix of a key over its share, one of the asking key's own prefixes, an idle session of
a key over its share, one of the asking key's own idle sessions; never from a key within
its share. So one key opening sessions by the hundred takes only from itself.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Literal


class Eviction:
    def __init__(self, max_sessions: int, key_share: int):
        """`key_share` 0: an equal share."""
        self.max_sessions = max_sessions
        self.key_share = key_share

    def share(self, held: Counter[str], asking: str | None = None) -> float:
        """A key's share: `key_share`, or an equal part of the sequences among the keys
        that hold any (and the one asking)."""
        if self.key_share:
            return self.key_share
        keys = set(held) | ({asking} if asking else set())
        return self.max_sessions / max(1, len(keys))

    def givers(self, held: Counter[str], owner: str) -> list[str]:
        """The keys to take a sequence from, in order: those over their share, the
        furthest over first (the asking key counts the one it asks for), then the asking
        key itself. A cached prefix of the first giver that has one goes first; else an
        idle session, in the same order."""
        share = self.share(held, owner)
        held = held + Counter({owner: 1})
        over = sorted(
            (key for key, n in held.items() if n > share),
            key=lambda key: (held[key] - share, key != owner),
            reverse=True,
        )
        return over if owner in over else [*over, owner]

    def choose(
        self,
        held: Counter[str],
        owner: str,
        prefixes: Iterable[tuple[int, str]],
        idle: Iterable[tuple[str, str]],
    ) -> tuple[Literal["prefix"], int] | tuple[Literal["session"], str] | None:
        """What to free for `owner`: ("prefix", seq id) or ("session", session id), the
        least recently used first of the first giver that has one (`prefixes`: cached
        prefixes' (seq id, key); `idle`: sessions that may go, as (session id, key),
        both least recently used first); None when nothing may go."""
        givers = self.givers(held, owner)
        prefixes, idle = list(prefixes), list(idle)
        for key in givers:
            for seq_id, holder in prefixes:
                if holder == key:
                    return "prefix", seq_id
        for key in givers:
            for session_id, holder in idle:
                if holder == key:
                    return "session", session_id
        return None

    def refusal(self, held: Counter[str], owner: str) -> str:
        """Why nothing could be taken (every candidate has a round in progress)."""
        if held[owner] + 1 > self.share(held, owner):
            return (
                f"this API key holds its share of the {self.max_sessions} sessions, each "
                "with a round in progress; retry shortly"
            )
        return (
            f"all {self.max_sessions} sessions are busy or held by keys within their share; "
            "retry shortly"
        )
