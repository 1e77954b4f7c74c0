"""Policy: how far each client's draft is verified while other API keys use the verifier.

A pass is as wide as its widest round, and a round that arrives while a pass runs waits
for it: one key's long drafts would make every other key's round wait for rows it never
asked for, whether those rounds share the long pass or arrive while it runs. So while
more than one key is present on the verifier, each client's draft is verified only as
far as the draft the verifier advises its session (at least one token). A key is
present while it has a round or a prompt being decoded (begun, past its checks), and for
`window_s` seconds after one was: a client's next round arrives a moment after its
answer, usually while the next pass runs, and that pass is the one it waits for. What
widens no pass makes no key present: a refused round, a replay answered from its record,
a round waiting for its grammar's masks. Alone, a key's drafts are verified whole: its
long drafts cost only itself.

Cut: every draft of the client's, a lookup the verifier sizes (draft_accept) too, where
it is a chunk's first step. Never cut: the verifier's own copies, a chunk's later steps
(no draft of the client's), and any round while the advice is unknown. A grammar's round keeps its
masks' first rows. The cut round says what it verified (`draft_verified`), a replay gets
the same answer, and a prefix of a draft is judged as the whole is: the answer is the
verifier's either way (greedy's tokens the same, sampled ones from its distribution; what
a seed repeats under a cut: docs/sampling.md). No session is exempt, a seeded one neither.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from server.verifier.decoding.jobs import VerifyWork
from server.verifier.kv.sessions import Session

Advice = Callable[[Session], int | None]  # the draft the verifier advises a session


class KeysPresent:
    """When each API key last had a round or a prompt decoded (`seen`), and
    which keys were seen within the last `window_s` seconds of `clock` (`recent`)."""

    def __init__(self, window_s: float = 0.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._last_seen: dict[str, float] = {}

    def seen(self, owners: Iterable[str]) -> None:
        if self.window_s <= 0:
            return
        now = self.clock()
        for owner in owners:
            self._last_seen[owner] = now

    def recent(self) -> set[str]:
        if self.window_s <= 0:
            return set()
        now = self.clock()
        gone = [o for o, at in self._last_seen.items() if now - at >= self.window_s]
        for owner in gone:  # the table holds only keys present
            del self._last_seen[owner]
        return set(self._last_seen)


def shares_the_verifier(round_owners: Iterable[str], present: Iterable[str]) -> bool:
    """Whether the rounds of a step are cut to their advice: more than one key among the
    rounds' owners and the keys present."""
    return len({*round_owners, *present}) > 1


def verified_length(drafted: int, advised: int | None) -> int:
    """How many of a draft's tokens are verified: the advice, at least one, at most the
    draft; the whole draft while the advice is unknown."""
    return drafted if advised is None else min(drafted, max(advised, 1))


def share_fairly(works: Sequence[VerifyWork], present: Iterable[str], advice: Advice) -> None:
    """Cut each client's draft among `works` (a step's rounds) to its session's advice,
    where more than one key shares the verifier (`shares_the_verifier`)."""
    if not shares_the_verifier((work.session.owner for work in works), present):
        return
    for work in works:
        if work.copied or not work.client_drafted:
            continue
        keep = verified_length(len(work.draft_tokens), advice(work.session))
        if keep < len(work.draft_tokens):
            work.cut(keep)
