"""`serve`'s slot pool: the longest cached prefix wins, the queue is bounded and first
come first served, and a request that leaves the queue leaves no trace."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from drafter.serve.slots import GenerationSlot, QueueFull, SlotPool, best_slot
from server.shared.prefix import common_prefix_len


def slot(cached: list[int], last_used: int = 0) -> GenerationSlot:
    return GenerationSlot(
        SimpleNamespace(cached_tokens=cached), SimpleNamespace(close=lambda: None), last_used
    )


def test_the_slot_with_the_longest_cached_prefix_wins_and_ties_go_to_the_least_recent():
    conversation, other, empty = slot([1, 2, 3, 4], 5), slot([1, 2, 9], 1), slot([], 2)
    assert best_slot([other, conversation, empty], [1, 2, 3, 4, 5]) is conversation
    assert best_slot([conversation, other, empty], [7, 8]) is other  # all 0: oldest use
    assert common_prefix_len([1, 2, 3], [1, 2]) == 2 and common_prefix_len([], [1]) == 0


def test_beyond_the_slots_requests_wait_in_a_bounded_queue_in_arrival_order():
    async def scenario():
        pool = SlotPool([slot([])], max_waiting=2)
        pool.admit()
        held = await pool.acquire([1])
        first = asyncio.create_task(pool.acquire([1]))
        second = asyncio.create_task(pool.acquire([1]))
        await asyncio.sleep(0)
        assert pool.waiting == 2 and pool.running == 1
        with pytest.raises(QueueFull):
            pool.admit()
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
            pool.admit()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert pool.waiting == 0
        pool.admit()  # room again
        pool.release(held)
        assert await pool.acquire([1]) is held  # and the slot was not lost to the leaver

    asyncio.run(scenario())
