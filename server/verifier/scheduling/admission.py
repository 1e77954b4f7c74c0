"""Admission: whether the queue takes one more request of a key.

The queue is shared fairly: a key that has work queued already is refused (503) when the
queue is full or the key holds its part of it (`max_queue` divided among the keys with
work queued, and one more). A key with nothing queued always gets in, so however many
keys flood it, another key's round is never refused: the queue goes past `max_queue` by
at most one request a key.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class QueueShare:
    def __init__(self, max_queue: int):
        self.max_queue = max_queue

    def refusal(self, queued_owners: Iterable[str], owner: str) -> str | None:
        """Why `owner`'s request is refused, given the owners of the queued requests;
        None: it gets in."""
        queued = Counter(queued_owners)
        total = sum(queued.values())
        others = len(set(queued) - {owner})
        part = max(1, self.max_queue // (others + 2))
        if queued[owner] and (total >= self.max_queue or queued[owner] >= part):
            return (
                f"the queue is full ({total} requests waiting, {queued[owner]} of them this "
                "key's); retry shortly"
            )
        return None
