"""`serve`'s generation slots: N draft sequences, each with its own verifier connection,
and a bounded queue of requests waiting for one.

A request takes the free slot whose cached tokens share the longest prefix with its
prompt (llama-server picks a slot the same way): a chat app's next turn lands where its
conversation is cached, and a title request beside it does not evict it. Event-loop
only: `acquire` and `release` are called on the server's event loop.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from drafter.client import VerifierClient
from drafter.model import DraftModel
from server.sessions import common_prefix_len

_use_order = itertools.count(1)


@dataclass(eq=False)
class Slot:
    model: DraftModel
    client: VerifierClient
    last_used: int = field(default=0)


class QueueFull(Exception):
    """Every slot is busy and the queue is full: the client should come back later."""


def best_slot(free: Sequence[Slot], prompt_ids: Sequence[int]) -> Slot:
    """The longest cached prefix of the prompt; among equals, the least recently used
    (its cache is the one least likely to be wanted again)."""
    return max(
        free, key=lambda s: (common_prefix_len(s.model.cached_tokens, prompt_ids), -s.last_used)
    )


class SlotPool:
    def __init__(self, slots: Sequence[Slot], max_waiting: int):
        self.slots = list(slots)
        self._free = list(slots)
        self._available = asyncio.Semaphore(len(slots))
        self.max_waiting = max_waiting
        self.waiting = 0

    @property
    def running(self) -> int:
        return len(self.slots) - len(self._free)

    def admit(self) -> None:
        """Refuse at once when waiting would overflow the queue (QueueFull)."""
        if not self._free and self.waiting >= self.max_waiting:
            raise QueueFull(
                f"{self.running} generations running and {self.waiting} waiting; try again"
            )

    async def acquire(self, prompt_ids: Sequence[int]) -> Slot:
        """Wait (first come, first served) for a slot; cancelling the wait leaves the
        queue."""
        self.waiting += 1
        try:
            await self._available.acquire()
        finally:
            self.waiting -= 1
        slot = best_slot(self._free, prompt_ids)
        self._free.remove(slot)
        slot.last_used = next(_use_order)
        return slot

    def release(self, slot: Slot) -> None:
        self._free.append(slot)
        self._available.release()

    def close(self) -> None:
        for slot in self.slots:
            slot.client.close()
