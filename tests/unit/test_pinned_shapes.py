"""Greedy exact where kernels change with the row count (as on a GPU), on the fake runtime
whose kernels do: every pass every sequence at one width, so every row of every pass,
speculative or `/generate`, is computed the same way."""

from __future__ import annotations

import asyncio

import pytest

from server.shared.protocol import PrefillRequest, VerifyRequest
from server.verifier.engine import engine_info
from tests.fixtures.fake_runtime import FakeRuntime, switches_by_rows
from tests.fixtures.stepped import make_engine, prefilled, stepped_scheduler
from tests.unit.test_engine_races import assert_consistent

MAX_DRAFT = 6
PROMPT = "a prompt long enough for several chunks of the pinned width, and then some"


def build(pin_shapes: str = "auto"):
    runtime = FakeRuntime(n_seq_max=4, n_batch=64, n_ctx_per_seq=256, kernel=switches_by_rows())
    engine = make_engine(runtime, max_draft=MAX_DRAFT, pin_shapes=pin_shapes)
    return runtime, engine, stepped_scheduler(engine)


async def drive(scheduler, *calls):
    tasks = [asyncio.ensure_future(call) for call in calls]
    while not all(task.done() for task in tasks):
        for _ in range(5):
            await asyncio.sleep(0)
        scheduler.run_step()
    return [task.result() for task in tasks]


async def alone(scheduler, n: int) -> list[int]:
    """The verifier alone: the prompt, then one plain step at a time (/generate's way)."""
    (opened,) = await drive(scheduler, prefilled(scheduler, PrefillRequest(prompt=PROMPT)))
    out, n_past = [], opened.total_tokens
    while len(out) < n:
        request = VerifyRequest(session_id=opened.session_id, n_past=n_past)
        (step,) = await drive(scheduler, scheduler.verify(request))
        out += step.tokens
        n_past = step.total_tokens
    return out[:n]


async def speculative(scheduler, expected: list[int], n: int) -> list[int]:
    """The same prompt, drafts of every length (right, wrong, cut short), beside another
    session's rounds and a long prompt being evaluated."""
    (opened, other) = await drive(
        scheduler,
        prefilled(scheduler, PrefillRequest(prompt=PROMPT)),
        prefilled(scheduler, PrefillRequest(prompt="someone else's prompt")),
    )
    busy = asyncio.ensure_future(prefilled(scheduler, PrefillRequest(prompt="x" * 120)))
    out, n_past, other_past, k = [], opened.total_tokens, other.total_tokens, 0
    while len(out) < n:
        draft = list(expected[len(out) : len(out) + k])
        if k % 3 == 2 and draft:
            draft[-1] = (draft[-1] + 1) % 60 + 2  # a wrong last token
        mine, theirs = await drive(
            scheduler,
            scheduler.verify(
                VerifyRequest(session_id=opened.session_id, n_past=n_past, draft_tokens=draft)
            ),
            scheduler.verify(
                VerifyRequest(session_id=other.session_id, n_past=other_past, draft_tokens=[9])
            ),
        )
        out += mine.tokens
        n_past, other_past = mine.total_tokens, theirs.total_tokens
        k = (k + 1) % (MAX_DRAFT + 1)
    await drive(scheduler, busy)
    return out[:n]


def test_the_probe_pins_shapes_where_free_ones_are_not_exact():
    _, engine, _ = build()
    info = engine_info(engine)
    assert info.pinned_width == MAX_DRAFT + 1 and info.batch_invariant
    assert info.strategies["greedy"] is True
    assert engine.prompt_chunk == MAX_DRAFT + 1  # prompts go at the pinned width too
    _, free, _ = build(pin_shapes="off")
    assert engine_info(free).pinned_width == 0 and not engine_info(free).batch_invariant


def test_with_pinned_shapes_greedy_speculation_equals_the_verifier_alone():
    runtime, engine, scheduler = build()

    async def scenario():
        expected = await alone(scheduler, 30)
        assert await speculative(scheduler, expected, 30) == expected

    asyncio.run(scenario())
    # Every decode was every sequence at the pinned width.
    widths = {len(d) for d in runtime.decodes[-20:]}
    assert widths == {4 * (MAX_DRAFT + 1)}
    assert_consistent(runtime, engine, scheduler)


@pytest.mark.parametrize("pin_shapes", ["off"])
def test_with_free_shapes_on_such_kernels_greedy_is_not_exact_and_says_so(pin_shapes):
    runtime, engine, scheduler = build(pin_shapes)

    async def scenario():
        expected = await alone(scheduler, 30)
        return expected, await speculative(scheduler, expected, 30)

    expected, got = asyncio.run(scenario())
    assert got != expected  # what pinning prevents
    assert engine.lossless("greedy") is False
    assert_consistent(runtime, engine, scheduler)
