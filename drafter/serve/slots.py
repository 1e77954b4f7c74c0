"""`serve`'s generation slots: N draft sequences, each with its own verifier connection,
and a bounded queue of requests waiting for one.

A request takes the free slot whose cached tokens share the longest prefix with its
prompt (llama-server picks a slot the same way): a chat app's next turn lands where its
conversation is cached, and a title request beside it does not evict it. Event-loop
only: `acquire` and `release` are called on the server's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from drafter.client import VerifierClient
from drafter.length_memory import LengthMemory
from drafter.model import DraftModel
from server.shared.prefix import common_prefix_len


@dataclass(eq=False)
class GenerationSlot:
    model: DraftModel
    client: VerifierClient
    last_used: int = field(default=0)
    # What `auto` measured in this slot's earlier generations (the machine's, the link's).
    length_memory: LengthMemory = field(default_factory=LengthMemory)


class QueueFull(Exception):
    """Every slot is busy and the queue is full: the client should come back later."""


def best_slot(free: Sequence[GenerationSlot], prompt_ids: Sequence[int]) -> GenerationSlot:
    """The longest cached prefix of the prompt; among equals, the least recently used
    (its cache is the one least likely to be wanted again)."""
    return max(
        free, key=lambda s: (common_prefix_len(s.model.cached_tokens, prompt_ids), -s.last_used)
    )


class SlotPool:
    def __init__(self, slots: Sequence[GenerationSlot], max_waiting: int):
        self.slots = list(slots)
        self._free = list(slots)
        self._available = asyncio.Semaphore(len(slots))
        self.max_waiting = max_waiting
        self.waiting = 0
        self._uses = 0

    @property
    def running(self) -> int:
        return len(self.slots) - len(self._free)

    def admit(self) -> None:
        """Refuse at once when waiting would overflow the queue (QueueFull)."""
        if not self._free and self.waiting >= self.max_waiting:
            raise QueueFull(
                f"all {self.running} generation slots are busy and {self.waiting} requests "
                "are waiting; try again shortly"
            )

    async def acquire(self, prompt_ids: Sequence[int]) -> GenerationSlot:
        """Wait (first come, first served) for a slot; cancelling the wait leaves the
        queue."""
        self.waiting += 1
        try:
            await self._available.acquire()
        finally:
            self.waiting -= 1
        slot = best_slot(self._free, prompt_ids)
        self._free.remove(slot)
        self._uses += 1
        slot.last_used = self._uses
        return slot

    def release(self, slot: GenerationSlot) -> None:
        self._free.append(slot)
        self._available.release()

    def close(self) -> None:
        for slot in self.slots:
            slot.client.close()
