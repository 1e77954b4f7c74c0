"""Holding rounds for the sessions a pass just answered (server/verifier/scheduling/gather.py): the
rule on a clock the tests move, then the scheduler's engine thread on a frozen clock, so
that whether a pass waits is decided by arrivals, never by how long anything takes."""

from __future__ import annotations

import asyncio
import threading

import pytest

from server.shared.protocol import PrefillRequest, VerifyRequest
from server.verifier.metrics import VerifierMetrics
from server.verifier.scheduling.gather import (
    FORGET_AFTER_S,
    FORGIVE_AFTER,
    HOLD_SHARE,
    MAX_MISSES,
    MAX_SKIPPED,
    RETURN_SLACK,
    Gatherer,
)
from server.verifier.scheduling.scheduler import BatchScheduler
from tests.fixtures.fake_runtime import FakeRuntime
from tests.fixtures.stepped import core_settings, make_engine, prefilled

A, B, C = ("k", "a"), ("k", "b"), ("other", "c")
COST_ROWS = 6.0


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now
        self.engine_reads = 0  # reads by the scheduler's engine thread

    def __call__(self) -> float:
        if threading.current_thread().name == "engine":
            self.engine_reads += 1
        return self.now


def gatherer(pinned: bool = False) -> tuple[Gatherer, Clock]:
    clock = Clock()
    gather = Gatherer(COST_ROWS, pinned=pinned, clock=clock)
    gather.observe_pass("rounds", rows=14, seconds=0.1)  # fixed part: 0.1 * 6 / 20
    return gather, clock


def returned(gather: Gatherer, clock: Clock, took: dict) -> None:
    """One cycle of rounds answered, each session back after `took[key]` seconds."""
    gather.answered(took)
    start = clock.now
    for key, seconds in sorted(took.items(), key=lambda item: item[1]):
        clock.now = start + seconds
        gather.arrived(key)
    clock.now = start + 1.0


def test_the_fixed_part_of_a_pass_bounds_the_hold():
    gather, _ = gatherer()
    assert gather.fixed_s == pytest.approx(0.1 * COST_ROWS / (COST_ROWS + 14))
    gather.observe_pass("prompt", rows=48, seconds=5.0)  # a prompt chunk changes nothing
    assert gather.fixed_s == pytest.approx(0.03)
    pinned, _ = gatherer(pinned=True)  # every pinned pass computes every sequence
    assert pinned.fixed_s == pytest.approx(0.1)


def test_a_session_coming_back_fast_is_waited_for_until_it_is_back():
    gather, clock = gatherer()
    returned(gather, clock, {A: 0.004, B: 0.006})
    answered_at = clock.now
    gather.answered([A, B])
    clock.now += 0.004
    gather.arrived(A)
    assert gather.deadline() == pytest.approx(answered_at + RETURN_SLACK * 0.006)
    gather.arrived(B)
    assert gather.deadline() is None  # everyone is back: run now


def test_the_hold_never_exceeds_a_pass_fixed_part_from_the_answer():
    gather, clock = gatherer()
    returned(gather, clock, {A: 0.002, B: 0.025})  # B: 2 x 0.025 is past 0.03
    answered_at = clock.now
    gather.answered([A, B])
    gather.arrived(A)
    assert gather.deadline() == pytest.approx(answered_at + 0.03)


def test_a_drafter_across_a_real_link_is_never_waited_for():
    gather, clock = gatherer()
    returned(gather, clock, {A: 0.002, C: 0.150})  # C's round trip exceeds a whole pass
    gather.answered([A, C])
    gather.arrived(A)
    assert gather.deadline() is None


def test_a_session_never_seen_coming_back_is_not_waited_for():
    gather, _ = gatherer()
    gather.answered([A, B])
    gather.arrived(A)
    assert gather.deadline() is None


def test_nothing_is_held_before_a_pass_of_rounds_was_timed():
    clock = Clock()
    gather = Gatherer(COST_ROWS, pinned=False, clock=clock)
    returned(gather, clock, {A: 0.001, B: 0.001})
    gather.answered([A, B])
    gather.arrived(A)
    assert gather.deadline() is None


def miss(gather: Gatherer, clock: Clock, key) -> int:
    """`key` misses a hold (A makes it); how many answers it then sits out."""
    gather.answered([A, key])
    gather.arrived(A)
    clock.now = gather.deadline() + 0.001
    assert gather.gave_up(held=True) == [key]
    clock.now += 0.05  # late for the hold, within a pass
    gather.arrived(key)
    answers = 0
    while not gather.waited_for(key):
        returned(gather, clock, {A: 0.002, key: 0.050})  # back within a pass: not a hold
        answers += 1
    return answers


def make(gather: Gatherer, clock: Clock, key) -> None:
    """`key` is back within a hold's bound."""
    gather.answered([A, key])
    clock.now += 0.001
    gather.arrived(key)
    gather.arrived(A)
    clock.now += 1.0


def test_a_session_that_misses_holds_sits_out_twice_as_many_answers_each_time():
    gather, clock = gatherer()
    returned(gather, clock, {A: 0.002, B: 0.004})
    assert [miss(gather, clock, B) for _ in range(3)] == [2, 4, 8]


def test_making_a_hold_now_and_then_does_not_undo_the_misses():
    """A client that comes back late on purpose every other hold: its misses still
    double what it sits out."""
    gather, clock = gatherer()
    returned(gather, clock, {A: 0.002, B: 0.004})
    sat_out = []
    for _ in range(4):
        sat_out.append(miss(gather, clock, B))
        make(gather, clock, B)
    assert sat_out == [2, 4, 8, 16]


def test_a_run_of_holds_made_earns_one_miss_back():
    gather, clock = gatherer()
    returned(gather, clock, {A: 0.002, B: 0.004})
    assert [miss(gather, clock, B) for _ in range(3)] == [2, 4, 8]
    for _ in range(FORGIVE_AFTER):
        make(gather, clock, B)
    assert miss(gather, clock, B) == 8  # three misses, one earned back, one more


def test_answered_sessions_that_never_come_back_are_forgotten():
    gather, clock = gatherer()
    returned(gather, clock, {A: 0.001, B: 0.001})
    gather.answered([A, B])
    clock.now += FORGET_AFTER_S + 1
    gather.answered([C])
    assert set(gather._sessions) == {C}


def test_misses_stop_counting_at_the_longest_sit_out():
    gather, clock = gatherer()
    returned(gather, clock, {A: 0.002, B: 0.004})
    assert [miss(gather, clock, B) for _ in range(9)][-3:] == [MAX_SKIPPED] * 3
    assert gather._sessions[B].misses == MAX_MISSES


def test_a_deadline_that_passed_with_no_hold_costs_nobody_a_miss():
    gather, clock = gatherer()
    returned(gather, clock, {A: 0.002, B: 0.004})
    gather.answered([A, B])
    clock.now += 0.05  # past the deadline; say a prompt chunk ran: nothing held for B
    assert gather.gave_up(held=False) == []
    assert gather.deadline() is None
    gather.arrived(B)
    assert gather.waited_for(B)


def test_a_session_being_deleted_or_finished_is_not_waited_for():
    gather, clock = gatherer()
    returned(gather, clock, {A: 0.002, B: 0.004})
    gather.answered([A, B])
    gather.arrived(A)
    assert gather.deadline() is not None
    gather.not_coming(B)
    assert gather.deadline() is None


def test_holds_never_take_more_than_their_share_of_the_decoding_time():
    """Whatever the clients do, e.g. come back just inside the bound every time."""
    gather, clock = gatherer()  # one pass of 0.1 s decoded so far
    returned(gather, clock, {A: 0.002, B: 0.004})
    gather.answered([A, B])
    gather.arrived(A)
    assert gather.deadline() is not None
    gather.held(HOLD_SHARE * 0.1)  # holds have taken their share
    assert gather.deadline() is None
    gather.observe_pass("rounds", rows=14, seconds=0.1)  # more decoding: room again
    gather.answered([A, B])
    gather.arrived(A)
    assert gather.deadline() is not None


# -- the engine thread ------------------------------------------------------------------


def threaded(gather_rounds: bool = True) -> tuple[FakeRuntime, BatchScheduler, Clock]:
    runtime = FakeRuntime(n_seq_max=4, n_batch=256, n_ctx_per_seq=512)
    engine = make_engine(runtime, max_draft=4, pass_cost_rows=COST_ROWS)
    metrics = VerifierMetrics(4, 4)
    settings = core_settings(max_queue=16, gather_rounds=gather_rounds)
    scheduler = BatchScheduler(engine, metrics, settings)
    clock = Clock()  # frozen unless the test moves it: no hold runs out by itself
    scheduler.gatherer = Gatherer(COST_ROWS, pinned=False, clock=clock)
    scheduler.start()
    return runtime, scheduler, clock


async def opened(scheduler: BatchScheduler, prompt: str) -> dict:
    answer = await asyncio.wait_for(prefilled(scheduler, PrefillRequest(prompt=prompt), "k"), 60)
    return {"id": answer.session_id, "ids": answer.prompt_ids, "n_past": answer.total_tokens}


async def queued(scheduler: BatchScheduler, session: dict) -> asyncio.Future:
    request = VerifyRequest(session_id=session["id"], n_past=session["n_past"])
    task = asyncio.ensure_future(scheduler.verify(request, "k"))
    while not task.done() and not any(j.session_id == session["id"] for j in scheduler._queue):
        await asyncio.sleep(0.001)
    return task


def sessions_per_pass(metrics: VerifierMetrics) -> tuple[float, float]:
    """(decodes of rounds, sessions in them) so far."""
    sample = metrics.registry.get_sample_value
    return sample("verifier_pass_sessions_count") or 0, sample("verifier_pass_sessions_sum") or 0


def metric(scheduler: BatchScheduler, name: str) -> float:
    return scheduler.metrics.registry.get_sample_value(name) or 0


async def engine_holding(clock: Clock, reads: int) -> None:
    """Until the engine thread has read the (frozen) clock since `reads`: it is in its
    hold, and stays there while the clock does not move and the other is not back."""
    while clock.engine_reads <= reads:
        await asyncio.sleep(0.001)


def fast_returns(scheduler: BatchScheduler, clock: Clock, a: dict, b: dict) -> None:
    """The gatherer has seen both sessions come back quickly, then a pass answer both."""
    gather = scheduler.gatherer
    gather.observe_pass("rounds", rows=10, seconds=1.0)
    keys = {("k", a["id"]): 0.001, ("k", b["id"]): 0.002}
    returned(gather, clock, keys)
    gather.answered(keys)


def test_a_round_waits_for_the_session_answered_with_it_and_they_share_a_pass():
    runtime, scheduler, clock = threaded()

    async def scenario():
        a, b = await opened(scheduler, "first drafter"), await opened(scheduler, "second one")
        fast_returns(scheduler, clock, a, b)
        passes_before = sessions_per_pass(scheduler.metrics)
        reads = clock.engine_reads
        first = await queued(scheduler, a)
        await asyncio.wait_for(engine_holding(clock, reads), 60)
        assert not first.done()
        second = await queued(scheduler, b)
        answers = await asyncio.wait_for(asyncio.gather(first, second), 60)
        assert [x.tokens for x in answers] == [
            runtime.reference_greedy(a["ids"], 1),
            runtime.reference_greedy(b["ids"], 1),
        ]
        count, sessions = sessions_per_pass(scheduler.metrics)
        assert (count - passes_before[0], sessions - passes_before[1]) == (1, 2)
        assert metric(scheduler, "verifier_gather_holds_total") == 1

    try:
        asyncio.run(scenario())
    finally:
        scheduler.close()


def test_a_hold_that_runs_out_runs_the_round_alone_and_stops_waiting_for_the_absent():
    runtime, scheduler, clock = threaded()

    async def scenario():
        a, b = await opened(scheduler, "first drafter"), await opened(scheduler, "second one")
        fast_returns(scheduler, clock, a, b)
        reads = clock.engine_reads
        first = await queued(scheduler, a)
        await asyncio.wait_for(engine_holding(clock, reads), 60)
        clock.now += 1.0  # past any hold
        with scheduler._wake:
            scheduler._wake.notify()
        answer = await asyncio.wait_for(first, 60)
        assert answer.tokens == runtime.reference_greedy(a["ids"], 1)
        assert metric(scheduler, "verifier_gather_holds_total") == 1
        # b missed its hold: it sits out its next answers
        assert not scheduler.gatherer.waited_for(("k", b["id"]))

    try:
        asyncio.run(scenario())
    finally:
        scheduler.close()


def test_with_gathering_off_a_round_never_waits_for_others():
    runtime, scheduler, clock = threaded(gather_rounds=False)

    async def scenario():
        a, b = await opened(scheduler, "first drafter"), await opened(scheduler, "second one")
        fast_returns(scheduler, clock, a, b)
        first = await queued(scheduler, a)
        answer = await asyncio.wait_for(first, 60)
        assert answer.tokens == runtime.reference_greedy(a["ids"], 1)
        assert metric(scheduler, "verifier_gather_holds_total") == 0

    try:
        asyncio.run(scenario())
    finally:
        scheduler.close()
