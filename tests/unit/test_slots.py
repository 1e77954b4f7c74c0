"""`serve`'s slot pool: the longest cached prefix of the request's own principal wins
(another's cache counts as empty, and is emptied before the request runs in it), the
queue is bounded and first come first served, a burst is counted as it is admitted
(never more waiting than the queue holds), and a request that leaves the queue leaves
no trace. Deterministic: the
event loop is stepped, never timed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from drafter.length.length_memory import LengthMemory
from drafter.principals import CacheScopes
from drafter.serve.chat_api import CompletionRequest
from drafter.serve.prompts import Prompted
from drafter.serve.replies import Choice, Started, begin_choice
from drafter.serve.slots import GenerationSlot, QueueFull, SlotPool, best_slot
from drafter.settings import HistoryScope
from server.shared.prefix import common_prefix_len
from server.shared.protocol import PromptInput


class CachedModel:
    """A draft model's cache as the slots see it: its tokens, and `reset` emptying them."""

    def __init__(self, cached: list[int]):
        self.cached_tokens = cached

    def reset(self) -> None:
        self.cached_tokens = []


def slot(cached: list[int], last_used: int = 0, principal: str | None = None) -> GenerationSlot:
    return GenerationSlot(
        CachedModel(cached), SimpleNamespace(close=lambda: None), last_used, principal=principal
    )


def test_the_slot_with_the_longest_cached_prefix_wins_and_ties_go_to_the_least_recent():
    conversation, other, empty = slot([1, 2, 3, 4], 5), slot([1, 2, 9], 1), slot([], 2)
    assert best_slot([other, conversation, empty], [1, 2, 3, 4, 5]) is conversation
    assert best_slot([conversation, other, empty], [7, 8]) is other  # all 0: oldest use
    assert common_prefix_len([1, 2, 3], [1, 2]) == 2 and common_prefix_len([], [1]) == 0


def test_another_principals_cache_counts_as_empty_and_its_own_is_reused():
    """The attack's shape: B's prompt shares a long prefix with A's recent one, and A's slot
    is no better to B than an empty one (the least recent wins the tie), nor does B learn
    the shared length; A's own repeat still lands on its cache."""
    prompt = [1, 2, 3, 4, 5, 6]
    a_slot, other = slot(prompt, 5, principal="key-0"), slot([], 1, principal="key-1")
    assert best_slot([a_slot, other], prompt, "key-1") is other
    assert best_slot([a_slot, slot([], 9, principal="key-1")], prompt, "key-1") is a_slot  # a tie
    assert best_slot([other, a_slot], prompt, "key-0") is a_slot
    # One principal (`user`, or no key): every slot's cache counts, as ever.
    shared = slot(prompt, 5)
    assert best_slot([slot([], 1), shared], prompt) is shared


def test_a_slot_claimed_by_another_principal_forgets_its_cache_and_its_measurements():
    taken = slot([1, 2, 3], principal="key-0")
    measured = taken.length_memory
    measured.step_s, measured.fit = 0.02, [0.01, 0.001]
    taken.claim("key-0")  # the same principal: kept
    assert taken.model.cached_tokens == [1, 2, 3] and taken.length_memory is measured
    taken.claim("key-1")
    assert taken.model.cached_tokens == [] and taken.length_memory == LengthMemory()
    assert taken.principal == "key-1" and measured.step_s == 0.02  # a new memory, not cleared
    taken.model.cached_tokens = [7, 8]
    taken.claim("key-1")
    assert taken.model.cached_tokens == [7, 8]


def test_a_request_takes_the_best_of_its_principals_slots_through_admission():
    async def scenario():
        prompt = [1, 2, 3, 4]
        a_slot, b_slot = slot(prompt, 2, principal="key-0"), slot([1, 2], 1, principal="key-1")
        pool = SlotPool([a_slot, b_slot], max_waiting=1)
        assert await pool.acquire(prompt, "key-1") is b_slot
        pool.release(b_slot)
        assert await pool.acquire(prompt, "key-0") is a_slot

    asyncio.run(scenario())


def test_beyond_the_slots_requests_wait_in_a_bounded_queue_in_arrival_order():
    async def scenario():
        pool = SlotPool([slot([])], max_waiting=2)
        held = await pool.acquire([1])
        first = asyncio.create_task(pool.acquire([1]))
        second = asyncio.create_task(pool.acquire([1]))
        await asyncio.sleep(0)
        assert pool.waiting == 2 and pool.running == 1
        with pytest.raises(QueueFull):
            pool.admit([1])
        pool.release(held)
        assert await first is held and not second.done()
        pool.release(held)
        assert await second is held
        assert pool.waiting == 0 and pool.running == 1

    asyncio.run(scenario())


def test_a_request_that_leaves_the_queue_frees_its_place():
    async def scenario():
        pool = SlotPool([slot([])], max_waiting=1)
        held = await pool.acquire([1])
        waiting = asyncio.create_task(pool.acquire([1]))
        await asyncio.sleep(0)
        with pytest.raises(QueueFull):
            pool.admit([1])
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert pool.waiting == 0
        pool.release(held)
        assert await pool.acquire([1]) is held  # and the slot was not lost to the leaver

    asyncio.run(scenario())


def test_a_burst_is_bounded_as_it_is_admitted_however_many_come_at_once():
    """Admission takes the place in the step that checks for it: of a burst admitted in
    one step of the loop, exactly the slots run and the queue's worth wait, the rest are
    refused; a turn left before the loop runs again frees its place at once."""

    async def scenario():
        pool = SlotPool([slot([]), slot([])], max_waiting=8)
        turns, refused = [], 0
        for _ in range(40):
            try:
                turns.append(pool.admit([1]))
            except QueueFull:
                refused += 1
        assert (len(turns), refused) == (10, 30)
        assert pool.running == 2 and pool.waiting == 8
        assert sum(turn.done() for turn in turns) == 2
        turns[-1].cancel()
        assert pool.waiting == 7
        turns.append(pool.admit([1]))  # its place, taken again
        with pytest.raises(QueueFull):
            pool.admit([1])
        for turn in turns[:2]:
            pool.release(turn.result())
        assert [turn.done() for turn in turns[2:5]] == [True, True, False]
        await asyncio.sleep(0)  # the cancelled turn's callback: nothing changes
        assert pool.waiting == 6 and pool.running == 2

    asyncio.run(scenario())


def test_a_waiter_that_leaves_with_its_slot_handed_over_gives_it_back():
    async def scenario():
        pool = SlotPool([slot([])], max_waiting=1)
        held = await pool.acquire([1])
        waiter = asyncio.create_task(pool.acquire([1]))
        await asyncio.sleep(0)
        pool.release(held)  # handed to the waiter, which has not run since
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert pool.running == 0 and pool.waiting == 0
        assert await pool.acquire([1]) is held

    asyncio.run(scenario())


class HeldBackend:
    """Generations that run until the test ends them, each slot given back as the real
    backend gives it back (drafter/serve/backend.py: start)."""

    def __init__(self, pool: SlotPool):
        self.pool = pool
        self.running: list[asyncio.Future] = []
        self.caches = CacheScopes(HistoryScope.user, from_auto=False)

    def start(self, slot: GenerationSlot, _generation) -> asyncio.Future:
        done = asyncio.get_running_loop().create_future()
        done.add_done_callback(lambda _: self.pool.release(slot))
        self.running.append(done)
        return done


def test_a_burst_of_requests_through_serves_admission_waits_no_more_than_the_queue():
    """40 requests at once, through the step that admits them (replies.begin_choice),
    against 2 slots and a queue of 8: 2 start, 8 wait, 30 are refused (429 queue_full);
    as generations end, the waiters start in the order they came."""

    async def scenario():
        pool = SlotPool([slot([]), slot([])], max_waiting=8)
        backend = HeldBackend(pool)
        request = CompletionRequest(model="any", prompt="hi", max_tokens=4)
        choice = Choice(0, Prompted(PromptInput(prompt="hi"), [1, 2]), 0)
        gone = asyncio.get_running_loop().create_future()  # nobody leaves

        async def one() -> Started | None:
            return await begin_choice(backend, pool, request, choice, 4, gone)

        requests = [asyncio.create_task(one()) for _ in range(40)]
        while sum(r.done() for r in requests) + pool.waiting < 40:
            await asyncio.sleep(0)
        refused = [r for r in requests if r.done() and isinstance(r.exception(), QueueFull)]
        started = [r for r in requests if r.done() and r.exception() is None]
        assert (len(started), len(refused), pool.waiting) == (2, 30, 8)
        queued = [r for r in requests if not r.done()]
        for n in range(len(queued)):
            backend.running[n].set_result(None)
            while not queued[n].done():
                await asyncio.sleep(0)
            assert [r.done() for r in queued] == [i <= n for i in range(len(queued))]
            assert isinstance(queued[n].result(), Started)
        assert pool.waiting == 0 and pool.running == 2
        for running in backend.running[len(queued) :]:
            running.set_result(None)
        await asyncio.sleep(0)
        assert pool.running == 0
        gone.cancel()

    asyncio.run(scenario())
