"""Packing: which KV sequence id a new session, or a reused prefix, takes.

llama.cpp runs sequences in one forward pass only when their ids rise by one
(server/shared/batching.py, `forward_passes`), so a gap among the sessions' ids costs a
pass. A new sequence goes where it adds the fewest runs of neighbouring ids to those that
sessions and prompts hold (beside them), preferring what needs fewer copies: a free id,
then the id of a cached prefix, which moves to a free id away from the sessions. A copy
costs one sequence's KV buffers, far less than evaluating a prompt; nothing moves when
that gains no run, when no id is free, or a live session.
"""

from __future__ import annotations

from collections.abc import Collection


def runs_added(seq_id: int, held: Collection[int]) -> int:
    """How many runs of neighbouring held ids taking `seq_id` adds (1, 0 or -1)."""
    return 1 - (seq_id - 1 in held) - (seq_id + 1 in held)


class Packing:
    """Where a sequence goes. `enabled` False: the lowest free id, or a reused prefix
    where it is (what llama.cpp's own server does)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def places(
        self,
        free: Collection[int],
        cached: Collection[int],
        held: Collection[int],
        reused: int | None = None,
    ) -> list[int]:
        """The ids to try, best first. `free`: empty ids; `cached`: ids holding a cached
        prefix (one of them can be taken only by moving its prefix to a free id);
        `held`: ids of sessions and prompts; `reused`: the id of a prefix being reused
        (None: a new empty sequence, and `free` must not be empty)."""
        if not self.enabled:
            return [min(free)] if reused is None else [reused]
        moves = 0 if reused is None else 1
        candidates = [(runs_added(s, held), moves, s) for s in free]
        if free:  # a prefix in the way needs a free id to go to
            candidates += [(runs_added(s, held), moves + 1, s) for s in cached]
        if reused is not None:
            candidates.append((runs_added(reused, held), 0, reused))
        return [seq_id for _, _, seq_id in sorted(candidates)]

    @staticmethod
    def spare(free: Collection[int], held: Collection[int]) -> int:
        """The free id a prefix moved out of the way goes to: the highest of those beside
        no held id, else the highest."""
        return max(free, key=lambda s: ((s - 1 in held) + (s + 1 in held) == 0, s))
