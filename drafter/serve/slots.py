"""`serve`'s generation slots: N draft sequences, each with its own verifier connection,
and a bounded queue of requests waiting for one.

A request takes the free slot whose cached tokens share the longest prefix with its
prompt (llama-server picks a slot the same way): a chat app's next turn lands where its
conversation is cached, and a title request beside it does not evict it. Only a slot
whose last request was the same principal's counts its cache (drafter/principals.py,
CacheScopes): another's is no prefix of this request's to reuse, nor to learn the length
of; the generation empties it (`claim`). Event-loop only: `admit`, `acquire` and
`release` are called on the server's event loop.

A request's place is taken when it is admitted, in the same step as the check, with no
await between them: a burst cannot all pass the check before any of it is counted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from drafter.client import VerifierClient
from drafter.drafters.model import DraftModel
from drafter.length.length_memory import LengthMemory
from server.shared.prefix import common_prefix_len


@dataclass(eq=False)
class GenerationSlot:
    model: DraftModel
    client: VerifierClient
    last_used: int = field(default=0)
    # What `auto` measured in this slot's earlier generations (the machine's, the link's).
    length_memory: LengthMemory = field(default_factory=LengthMemory)
    principal: str | None = None  # whose caches it holds (its last generation's principal)

    def claim(self, principal: str | None) -> None:
        """Made `principal`'s before its generation: another's cached tokens and
        measurements go, so that neither its draft cache nor how `auto` starts tells it
        what the other sent. Worker thread, while the slot is taken."""
        if principal != self.principal:
            self.model.reset()
            self.length_memory = LengthMemory()
            self.principal = principal


class QueueFull(Exception):
    """Every slot is busy and the queue is full: the client should come back later."""


def best_slot(
    free: Sequence[GenerationSlot], prompt_ids: Sequence[int], principal: str | None = None
) -> GenerationSlot:
    """The longest cached prefix of the prompt among `principal`'s slots (another's
    counts as empty); among equals, the least recently used (its cache is the one least
    likely to be wanted again)."""

    def reused(slot: GenerationSlot) -> int:
        if slot.principal != principal:
            return 0
        return common_prefix_len(slot.model.cached_tokens, prompt_ids)

    return max(free, key=lambda s: (reused(s), -s.last_used))


class SlotPool:
    def __init__(self, slots: Sequence[GenerationSlot], max_waiting: int):
        self.slots = list(slots)
        # Free slots only while nobody waits: a slot given back goes to the first waiter.
        self._free = list(slots)
        self._queue: deque[asyncio.Future[GenerationSlot]] = deque()  # the waiting turns
        self.max_waiting = max_waiting
        self._uses = 0

    @property
    def running(self) -> int:
        return len(self.slots) - len(self._free)

    @property
    def waiting(self) -> int:
        return sum(not turn.done() for turn in self._queue)

    def admit(
        self, prompt_ids: Sequence[int], principal: str | None = None
    ) -> asyncio.Future[GenerationSlot]:
        """The request's turn, taken now: a future that holds its slot (the best of
        `principal`'s caches, `best_slot`) at once where one is free, else the first
        given back once the requests before it have theirs; QueueFull at once where the
        queue is full. Cancelling the turn leaves the queue; a slot it got goes back with
        `release`."""
        turn: asyncio.Future[GenerationSlot] = asyncio.get_running_loop().create_future()
        if self._free:
            turn.set_result(self._take(best_slot(self._free, prompt_ids, principal)))
            return turn
        if self.waiting >= self.max_waiting:
            raise QueueFull(
                f"all {self.running} generation slots are busy and {self.waiting} requests "
                "are waiting; try again shortly"
            )
        self._queue.append(turn)
        turn.add_done_callback(self._left)
        return turn

    async def acquire(
        self, prompt_ids: Sequence[int], principal: str | None = None
    ) -> GenerationSlot:
        """Admitted and waited for; cancelling the wait leaves the queue, or gives back the
        slot it got."""
        turn = self.admit(prompt_ids, principal)
        try:
            return await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release(turn.result())
            raise

    def release(self, slot: GenerationSlot) -> None:
        while self._queue:
            turn = self._queue.popleft()
            if not turn.done():  # not left
                turn.set_result(self._take(slot))
                return
        self._free.append(slot)

    def _take(self, slot: GenerationSlot) -> GenerationSlot:
        with contextlib.suppress(ValueError):  # a slot given back straight to a waiter
            self._free.remove(slot)
        self._uses += 1
        slot.last_used = self._uses
        return slot

    def _left(self, turn: asyncio.Future[GenerationSlot]) -> None:
        if turn.cancelled():
            with contextlib.suppress(ValueError):  # already taken off by `release`
                self._queue.remove(turn)

    def close(self) -> None:
        for slot in self.slots:
            slot.client.close()
