"""The KV sequence ids: which are free, and what is done to an id's cells (emptied,
trimmed, copied to another id) through the runtime's calls."""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class SequenceIds:
    def __init__(
        self, n_seq: int, remove: Callable[[int, int], None], copy: Callable[[int, int], None]
    ):
        """`remove(seq_id, p0)` drops an id's cells from position p0 on (-1: all of them);
        `copy(src, dst)` makes dst hold what src holds."""
        self.remove = remove
        self.copy = copy
        self._free = list(range(n_seq - 1, -1, -1))

    @property
    def free(self) -> list[int]:
        return sorted(self._free)

    def take(self, seq_id: int) -> None:
        self._free.remove(seq_id)

    def release(self, seq_id: int) -> None:
        """The id is free again, emptied (if emptying fails, it is free all the same and
        the error is raised: whoever takes it next empties it first)."""
        try:
            self.remove(seq_id, -1)
        finally:
            self._free.append(seq_id)

    def release_quietly(self, seq_id: int) -> None:
        """As `release`, a failure to empty it logged instead of raised."""
        try:
            self.release(seq_id)
        except Exception:
            log.exception("could not empty a sequence given back; emptied when taken")
