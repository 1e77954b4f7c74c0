"""Greedy exact where kernels change with the row count (as on a GPU), on the fake runtime
whose kernels do: every pass every sequence at one width, so every row of every pass,
speculative or `/generate`, is computed the same way; where the output projection changes
with the rows it projects too (CUDA's), every row's logits computed in every pass."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from server.shared.protocol import PrefillRequest, VerifyRequest
from server.verifier.decoding.engine import engine_info
from tests.fixtures.fake_runtime import FakeRuntime, same_head, switches_by_rows
from tests.fixtures.stepped import make_engine, prefilled, stepped_scheduler
from tests.unit.test_engine_races import assert_consistent

MAX_DRAFT = 6
PROMPT = "a prompt long enough for several chunks of the pinned width, and then some"


def by_rows_projected(rows: int) -> int:
    """An output projection whose kernel is another for every count of rows (as CUDA's
    vector kernel is, by its columns)."""
    return rows


def build(pin_shapes: str = "auto", head=same_head):
    runtime = FakeRuntime(
        n_seq_max=4, n_batch=64, n_ctx_per_seq=256, kernel=switches_by_rows(), head=head
    )
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
    assert info.pinned_logits is False  # rows pinned suffice here: no logits computed unread
    assert info.strategies["greedy"] is True
    assert engine.prompt_chunk == MAX_DRAFT + 1  # prompts go at the pinned width too
    _, free, _ = build(pin_shapes="off")
    assert engine_info(free).pinned_width == 0 and not engine_info(free).batch_invariant
    # Inexact free shapes are timed all the same: the planner needs the trade between
    # padding rows and more passes, or it would give every round a pass of its own.
    assert len(free.invariance.pass_s) == 3


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


def test_where_the_projection_changes_with_its_rows_the_probe_pins_every_logit_too():
    _, engine, _ = build(head=by_rows_projected)
    info = engine_info(engine)
    assert info.pinned_width == MAX_DRAFT + 1 and info.pinned_logits is True
    assert info.batch_invariant and info.strategies["greedy"] is True


@pytest.mark.parametrize("every_logit", [True, False])
def test_with_every_logit_computed_greedy_speculation_equals_the_verifier_alone(every_logit):
    runtime, engine, scheduler = build(head=by_rows_projected)
    engine.shapes = replace(engine.shapes, pinned_logits=every_logit)

    async def scenario():
        expected = await alone(scheduler, 30)
        return expected, await speculative(scheduler, expected, 30)

    expected, got = asyncio.run(scenario())
    assert (got == expected) is every_logit  # rows pinned alone leave the projection free
    assert_consistent(runtime, engine, scheduler)


def test_a_pinned_pass_decoded_again_job_by_job_still_computes_every_logit():
    runtime, engine, scheduler = build(head=by_rows_projected)
    assert engine.shapes.pinned_logits

    async def scenario():
        expected = await alone(scheduler, 12)
        # Every pass with two sessions' rounds fails: each is decoded again alone.
        runtime.fail_decode = lambda entries: len({e.seq_id for e in entries if e.want_logits}) > 1
        return expected, await speculative(scheduler, expected, 12)

    probed = len(runtime.decodes)  # the startup probe's decodes, some of other shapes
    expected, got = asyncio.run(scenario())
    assert got == expected
    served = zip(runtime.projected_rows[probed:], runtime.decodes[probed:], strict=True)
    assert all(rows == len(entries) for rows, entries in served)
    assert_consistent(runtime, engine, scheduler)


def test_the_probe_checks_the_widest_pass_the_planner_can_make():
    # A kernel that changes only in passes of more than 16 rows: rounds of 4 sessions, 7
    # rows each, make such a pass, whatever pass cost the settings give.
    runtime = FakeRuntime(
        n_seq_max=4, n_batch=64, n_ctx_per_seq=256, kernel=switches_by_rows(999, 16)
    )
    engine = make_engine(runtime, max_draft=MAX_DRAFT, pin_shapes="off")
    assert engine.shapes.plan({s: MAX_DRAFT + 1 for s in range(4)})[0].rows > 16
    assert engine_info(engine).batch_invariant is False


def spans_past(cells: int):
    """An attention whose kernel changes once the longest sequence holds more than `cells`
    (CUDA's flash attention splits the keys by the span, llama.cpp's `n_kv`)."""
    return lambda longest: longest > cells


@pytest.mark.parametrize("pin_shapes", ["auto", "on", "off"])
def test_the_probe_sees_a_row_change_with_the_longest_sequence_beside_it(pin_shapes):
    # Every pass shape is exact here but for the span: a short round beside a long
    # sequence is not what the same round decodes while every sequence is short.
    runtime = FakeRuntime(n_seq_max=4, n_batch=64, n_ctx_per_seq=256, span=spans_past(128))
    engine = make_engine(runtime, max_draft=MAX_DRAFT, pin_shapes=pin_shapes)
    info = engine_info(engine)
    assert info.batch_invariant is False and info.batch_max_diff > 0
    assert info.strategies["greedy"] is False
    # The same runtime without the span's kernel: exact (free shapes unless forced).
    runtime = FakeRuntime(n_seq_max=4, n_batch=64, n_ctx_per_seq=256)
    assert engine_info(
        make_engine(runtime, max_draft=MAX_DRAFT, pin_shapes=pin_shapes)
    ).batch_invariant


def test_a_lone_sequence_is_not_probed_beside_another():
    # One sequence: nothing can hold a longer context beside it, and its own long
    # context is the verifier alone's too.
    runtime = FakeRuntime(n_seq_max=1, n_batch=64, n_ctx_per_seq=256, span=spans_past(128))
    assert engine_info(make_engine(runtime, max_draft=MAX_DRAFT)).batch_invariant
