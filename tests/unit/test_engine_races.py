"""Races and failures of the verifier core, reproduced deterministically on a fake runtime.

No engine thread runs: the scheduler is built with `start=False` and each test drives
its passes by hand, so what shares a batch, and in what order jobs arrive, is decided by
the test, never by how threads happen to be scheduled. After every provoked failure:
every other session decodes exactly as before, the failing session is unchanged or
cleanly gone, and no seq id is lost.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from server.shared.protocol import PrefillRequest, SamplingParams, VerifyRequest
from server.verifier.decoding import rounds as rounds_module
from server.verifier.decoding.engine import Engine, engine_info
from server.verifier.errors import (
    DecodeFailed,
    EngineInterrupted,
    InternalError,
    InvalidDraftProbs,
    InvalidToken,
    NonFiniteNumbers,
    NPastMismatch,
    ServerFull,
    SessionBusy,
    SessionNotFound,
)
from server.verifier.metrics import VerifierMetrics
from server.verifier.scheduling.scheduler import BatchScheduler
from tests.fixtures.fake_runtime import FakeRuntime, switches_by_rows
from tests.fixtures.invariants import check_engine
from tests.fixtures.stepped import core_settings, make_engine, prefilled, stepped_scheduler

MAX_DRAFT = 8


def build(
    *, max_sessions: int = 4, n_batch: int = 64, ttl_s: float = 600.0
) -> tuple[FakeRuntime, Engine, BatchScheduler]:
    runtime = FakeRuntime(n_seq_max=max_sessions, n_batch=n_batch)
    engine = make_engine(runtime, max_draft=MAX_DRAFT)
    scheduler = stepped_scheduler(engine, session_ttl_s=ttl_s)
    return runtime, engine, scheduler


async def drive(scheduler: BatchScheduler, *calls) -> list:
    """Start `calls` in order, run engine passes until all are answered; each result or
    the exception it raised."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    for _ in range(200):
        for _ in range(5):  # answers cross from the futures to the tasks in a few steps
            await asyncio.sleep(0)
        if all(task.done() for task in tasks):
            break
        scheduler.run_step()
    else:
        raise AssertionError("calls still pending after 200 passes")
    return await asyncio.gather(*tasks, return_exceptions=True)


def run(coro):
    return asyncio.run(coro)


async def open_session(scheduler: BatchScheduler, prompt: str, **request) -> dict:
    (response,) = await drive(
        scheduler, prefilled(scheduler, PrefillRequest(prompt=prompt, **request))
    )
    assert not isinstance(response, Exception), response
    return {"id": response.session_id, "ids": response.prompt_ids, "n_past": response.total_tokens}


def verify_request(session: dict, draft: list[int], n_past: int | None = None) -> VerifyRequest:
    n_past = session["n_past"] if n_past is None else n_past
    return VerifyRequest(session_id=session["id"], n_past=n_past, draft_tokens=draft)


async def continue_alone(scheduler: BatchScheduler, session: dict, n_tokens: int) -> list[int]:
    """The session's next tokens by plain decoding steps (empty drafts)."""
    out: list[int] = []
    while len(out) < n_tokens:
        (step,) = await drive(scheduler, scheduler.verify(verify_request(session, [])))
        assert not isinstance(step, Exception), step
        out += step.tokens
        session["n_past"] = step.total_tokens
    return out[:n_tokens]


def assert_consistent(
    runtime: FakeRuntime, engine: Engine, scheduler: BatchScheduler | None = None
) -> None:
    """No seq id lost or doubled; each live session's cells are exactly its committed
    tokens but the pending one; every other sequence is empty; nothing left in flight."""
    check_engine(engine)
    if scheduler is not None:
        assert scheduler.queue_depth == 0 and not scheduler._rounds
    live = {}
    for session in engine.sessions.sessions():
        live[session.seq_id] = session
        assert runtime.cells[session.seq_id] == session.tokens[:-1], session.session_id
        assert session.work is None
    cached = engine.sessions.cached_prefixes
    for seq_id, prefix in cached.items():
        assert runtime.cells[seq_id] == prefix.tokens, f"cached seq {seq_id} differs"
    for seq_id, cells in runtime.cells.items():
        if seq_id not in live and seq_id not in cached and seq_id not in engine.sessions.reserved:
            assert cells == [], f"seq {seq_id} holds cells no session owns"


# -- one round per session at a time --------------------------------------------------


def test_identical_rounds_sent_at_once_get_one_decode_and_one_answer():
    runtime, engine, scheduler = build()

    async def scenario():
        session = await open_session(scheduler, "hello there")
        await open_session(scheduler, "someone else")
        expected = runtime.reference_greedy(session["ids"], 12)
        draft = expected[:3]
        before = runtime.decoded_tokens_total
        answers = await drive(
            scheduler, *[scheduler.verify(verify_request(session, draft)) for _ in range(3)]
        )
        assert not any(isinstance(a, Exception) for a in answers), answers
        assert answers[0] == answers[1] == answers[2]
        assert answers[0].tokens == expected[:4]
        assert runtime.decoded_tokens_total - before == len(draft) + 1  # decoded once
        assert scheduler.metrics.registry.get_sample_value("verifier_replayed_rounds_total") == 2
        session["n_past"] = answers[0].total_tokens
        assert expected[:4] + await continue_alone(scheduler, session, 8) == expected

    run(scenario())
    assert_consistent(runtime, engine, scheduler)


def test_duplicates_queued_in_one_pass_get_the_first_ones_answer():
    runtime, engine, scheduler = build()
    metrics = scheduler.metrics

    async def scenario():
        a = await open_session(scheduler, "first session")
        b = await open_session(scheduler, "second session")
        expected_a = runtime.reference_greedy(a["ids"], 6)
        expected_b = runtime.reference_greedy(b["ids"], 6)
        calls = [
            scheduler.verify(verify_request(a, expected_a[:2])),
            scheduler.verify(verify_request(b, [3, 4])),
            scheduler.verify(verify_request(a, expected_a[:2])),
            scheduler.verify(verify_request(a, expected_a[:2])),
        ]
        answers = await drive(scheduler, *calls)
        assert answers[0] == answers[2] == answers[3]
        assert answers[0].tokens == expected_a[:3]
        assert answers[1].tokens[0] == expected_b[0]
        assert metrics.registry.get_sample_value("verifier_replayed_rounds_total") == 2
        assert scheduler.queue_depth == 0

    run(scenario())
    assert_consistent(runtime, engine)


def test_a_different_round_in_flight_waits_then_gets_409():
    runtime, engine, scheduler = build()

    async def scenario():
        session = await open_session(scheduler, "a prompt")
        first, second = await drive(
            scheduler,
            scheduler.verify(verify_request(session, [5, 6])),
            scheduler.verify(verify_request(session, [7])),
        )
        assert not isinstance(first, Exception)
        assert isinstance(second, NPastMismatch)
        assert second.headers == {"X-Total-Tokens": str(first.total_tokens)}

    run(scenario())
    assert_consistent(runtime, engine)


def test_the_engine_never_holds_two_rounds_of_one_session():
    runtime, engine, _ = build()
    prefill = engine.begin_prefill(PrefillRequest(prompt="abc"))
    engine.run([], [prefill])
    session = prefill.session
    request = VerifyRequest(session_id=session.session_id, n_past=len(session.tokens))
    work = engine.begin_verify(request)
    with pytest.raises(SessionBusy):
        engine.begin_verify(request.model_copy(update={"draft_tokens": [9]}))
    (response,) = engine.run([work]).results
    assert engine.begin_verify(request) is response  # a replay: the recorded answer
    assert_consistent(runtime, engine)


def test_a_caller_that_goes_away_does_not_cancel_its_round():
    runtime, engine, scheduler = build()

    async def scenario():
        session = await open_session(scheduler, "patience")
        request = verify_request(session, [])
        gone = asyncio.ensure_future(scheduler.verify(request))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        assert scheduler.queue_depth == 1  # the round still runs
        before = runtime.decoded_tokens_total
        (retry,) = await drive(scheduler, scheduler.verify(request))
        assert retry.tokens == runtime.reference_greedy(session["ids"], 1)
        assert runtime.decoded_tokens_total - before == 1  # the one round, decoded once
        assert scheduler.metrics.registry.get_sample_value("verifier_replayed_rounds_total") == 1

    run(scenario())
    assert_consistent(runtime, engine, scheduler)


# -- the session table does not move under a round ------------------------------------


def test_a_delete_queued_behind_a_round_waits_for_it_and_frees_nothing_early():
    runtime, engine, scheduler = build(max_sessions=2)

    async def scenario():
        s = await open_session(scheduler, "session s")
        t = await open_session(scheduler, "session t")
        expected_s = runtime.reference_greedy(s["ids"], 3)
        s_seq = engine.session(s["id"]).seq_id
        answers = await drive(
            scheduler,
            scheduler.verify(verify_request(s, expected_s[:2])),
            scheduler.end(s["id"], "anonymous"),
            prefilled(scheduler, PrefillRequest(prompt="a newcomer")),
        )
        round_s, deleted, newcomer = answers
        assert round_s.tokens == expected_s[:3]
        assert deleted is None
        # The newcomer did not get the sequence of the round that was in the batch.
        assert engine.session(newcomer.session_id).seq_id != s_seq
        with pytest.raises(SessionNotFound):
            engine.session(t["id"])  # the idle one was evicted instead
        with pytest.raises(SessionNotFound):
            engine.session(s["id"])
        fresh = {"id": newcomer.session_id, "n_past": newcomer.total_tokens}
        expected = runtime.reference_greedy(newcomer.prompt_ids, 5)
        assert await continue_alone(scheduler, fresh, 5) == expected

    run(scenario())
    assert_consistent(runtime, engine)


def test_expiry_and_eviction_never_take_a_session_with_a_round():
    runtime, engine, _scheduler = build(max_sessions=2)
    works = []
    for prompt in ("busy one", "idle one"):
        prefill = engine.begin_prefill(PrefillRequest(prompt=prompt))
        engine.run([], [prefill])
        works.append(prefill.session)
    busy, idle = works
    work = engine.begin_verify(VerifyRequest(session_id=busy.session_id, n_past=len(busy.tokens)))
    assert engine.sessions.expire(-1.0, 600.0) == [idle.session_id]  # expired: only the idle one
    engine.begin_prefill(PrefillRequest(prompt="takes the free one"))
    with pytest.raises(ServerFull):  # nothing idle left to evict
        engine.begin_prefill(PrefillRequest(prompt="one too many"))
    with pytest.raises(SessionBusy):
        engine.sessions.delete(busy.session_id)
    (response,) = engine.run([work]).results
    expected = runtime.reference_greedy(busy.tokens[: busy.prompt_len], 1)
    assert response.tokens == expected
    check_engine(engine)


def test_the_sweep_keeps_sessions_with_work_queued():
    runtime, engine, scheduler = build()
    scheduler.settings = scheduler.settings.model_copy(update={"session_ttl_s": -1.0})

    async def scenario():
        waiting = await open_session(scheduler, "queued")
        await open_session(scheduler, "not queued")
        task = asyncio.ensure_future(scheduler.verify(verify_request(waiting, [])))
        await asyncio.sleep(0)
        scheduler.sweep()  # every idle session is past its TTL; the round is still queued
        assert engine.session_count == 1
        (answer,) = await drive(scheduler, task)
        assert answer.tokens == runtime.reference_greedy(waiting["ids"], 1)

    run(scenario())
    assert_consistent(runtime, engine)


# -- failures undo exactly their own job ----------------------------------------------


def test_a_decode_failing_for_one_job_of_four_fails_only_that_job():
    runtime, engine, scheduler = build()

    async def scenario():
        sessions = [await open_session(scheduler, f"prompt number {i}") for i in range(4)]
        expected = [runtime.reference_greedy(s["ids"], 10) for s in sessions]
        bad_seq = engine.session(sessions[2]["id"]).seq_id
        runtime.fail_decode = lambda entries: any(e.seq_id == bad_seq for e in entries)
        answers = await drive(
            scheduler,
            *[
                scheduler.verify(verify_request(s, e[:3]))
                for s, e in zip(sessions, expected, strict=False)
            ],
        )
        runtime.fail_decode = None
        assert isinstance(answers[2], DecodeFailed)
        assert answers[2].status_code == 500
        for i in (0, 1, 3):
            assert answers[i].tokens == expected[i][:4]
            sessions[i]["n_past"] = answers[i].total_tokens
        assert_consistent(runtime, engine)
        # The failed session is exactly as before its round; the others go on unchanged.
        assert await continue_alone(scheduler, sessions[2], 10) == expected[2]
        for i in (0, 1, 3):
            assert expected[i][:4] + await continue_alone(scheduler, sessions[i], 6) == expected[i]

    run(scenario())
    assert_consistent(runtime, engine)


@pytest.mark.parametrize("strategy", ["greedy", "match"])
def test_an_exception_after_the_decode_undoes_that_round_only(monkeypatch, strategy):
    runtime, engine, scheduler = build()
    sampling = {} if strategy == "greedy" else {"sampling": SamplingParams(temperature=0.8, seed=7)}
    real_judge = rounds_module.judge
    broken = {}

    def judge(strategy, draft_tokens, *args):
        verdict = real_judge(strategy, draft_tokens, *args)  # consumes the stream too
        if draft_tokens == [4, 5] and broken.pop("armed", False):
            raise RuntimeError("a bug after the decode")
        return verdict

    monkeypatch.setattr(rounds_module, "judge", judge)

    async def scenario():
        victim = await open_session(scheduler, "victim", strategy=strategy, **sampling)
        bystander = await open_session(scheduler, "bystander")
        twin = await open_session(scheduler, "victim", strategy=strategy, **sampling)
        broken["armed"] = True
        failed, ok = await drive(
            scheduler,
            scheduler.verify(verify_request(victim, [4, 5])),
            scheduler.verify(verify_request(bystander, [])),
        )
        assert isinstance(failed, InternalError) and failed.status_code == 500
        assert ok.tokens == runtime.reference_greedy(bystander["ids"], 1)
        assert_consistent(runtime, engine)
        # Cells, tokens and random stream as before: the victim now answers exactly as
        # its twin, which never failed.
        assert await continue_alone(scheduler, victim, 8) == await continue_alone(
            scheduler, twin, 8
        )

    run(scenario())
    assert_consistent(runtime, engine)


def test_logits_that_are_not_finite_fail_that_round_only_with_500():
    """NaN or inf from the model (a broken build, an overflow): 500 non_finite_numbers
    for that round, which leaves its session as it was; the round beside it is answered."""
    runtime, engine, scheduler = build()
    logits_after = runtime.logits_after
    poisoned = {}

    def sometimes_nan(prefix, kernels=()):
        row = logits_after(prefix, kernels)
        armed = poisoned.get("prefix")
        if armed is not None and list(prefix[: len(armed)]) == armed:
            row = row.copy()
            row[3] = np.nan
        return row

    runtime.logits_after = sometimes_nan

    async def scenario():
        victim = await open_session(scheduler, "victim")
        bystander = await open_session(scheduler, "bystander")
        twin = await open_session(scheduler, "victim")
        poisoned["prefix"] = victim["ids"]  # the twin's cells are the same: armed after
        failed, ok = await drive(
            scheduler,
            scheduler.verify(verify_request(victim, [4])),
            scheduler.verify(verify_request(bystander, [])),
        )
        assert isinstance(failed, NonFiniteNumbers) and failed.status_code == 500
        assert failed.error_type == "non_finite_numbers"
        assert ok.tokens == runtime.reference_greedy(bystander["ids"], 1)
        assert_consistent(runtime, engine)
        poisoned.clear()
        assert await continue_alone(scheduler, victim, 6) == await continue_alone(
            scheduler, twin, 6
        )

    run(scenario())
    assert_consistent(runtime, engine)


def test_a_prefill_failing_half_way_frees_its_sequence_and_spares_the_others():
    runtime, engine, scheduler = build(n_batch=16)

    async def scenario():
        session = await open_session(scheduler, "short")
        expected = runtime.reference_greedy(session["ids"], 6)
        count = engine.session_count
        seq_of = {}

        def second_chunk_of_the_long_prompt(entries):
            return any(e.seq_id == seq_of.get("long") and e.pos >= 16 for e in entries)

        runtime.fail_decode = second_chunk_of_the_long_prompt
        # 24 tokens to evaluate: a chunk of 16, then 8; each chunk is decoded on its own.
        long_prompt = prefilled(scheduler, PrefillRequest(prompt="x" * 24))
        task = asyncio.ensure_future(long_prompt)
        await asyncio.sleep(0)
        scheduler.run_step()  # the first chunk goes in
        seq_of["long"] = next(iter(engine.sessions.reserved))
        failed, answer = await drive(
            scheduler, task, scheduler.verify(verify_request(session, expected[:2]))
        )
        runtime.fail_decode = None
        assert isinstance(failed, DecodeFailed)
        assert answer.tokens == expected[:3]
        assert engine.session_count == count
        assert runtime.cells[seq_of["long"]] == []
        session["n_past"] = answer.total_tokens
        assert expected[:3] + await continue_alone(scheduler, session, 3) == expected

    run(scenario())
    assert_consistent(runtime, engine)


def test_a_bug_in_a_pass_undoes_what_it_had_begun(monkeypatch):
    runtime, engine, scheduler = build()

    async def scenario():
        session = await open_session(scheduler, "steady")
        expected = runtime.reference_greedy(session["ids"], 5)
        monkeypatch.setattr(engine, "run", _raise)
        (failed,) = await drive(scheduler, scheduler.verify(verify_request(session, [1])))
        monkeypatch.undo()
        # Undone, so worth sending again: a 503 the drafter retries.
        assert isinstance(failed, EngineInterrupted) and failed.status_code == 503
        assert engine.session(session["id"]).work is None
        assert_consistent(runtime, engine)
        assert await continue_alone(scheduler, session, 5) == expected

    run(scenario())
    assert_consistent(runtime, engine, scheduler)


def _raise(*args, **kwargs):
    raise RuntimeError("a bug in a pass")


# -- request consistency --------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["greedy", "match", "rejection"])
def test_draft_probs_must_match_the_draft_whatever_the_strategy(strategy):
    runtime, engine, scheduler = build()
    sampling = {} if strategy == "greedy" else {"sampling": SamplingParams(temperature=0.9, seed=3)}

    async def scenario():
        session = await open_session(scheduler, "one", strategy=strategy, **sampling)
        twin = await open_session(scheduler, "one", strategy=strategy, **sampling)
        request = verify_request(session, [5, 6])
        bad = [
            ([[(5, 1.0)], [(6, 1.0)], [(7, 1.0)]], InvalidDraftProbs),  # more rows than tokens
            ([[(5, 1.0)]], InvalidDraftProbs),  # fewer
            ([[(5, 0.5)], [(6, 1.0)]], InvalidDraftProbs),  # not a distribution
            ([[(4, 1.0)], [(6, 1.0)]], InvalidDraftProbs),  # no mass on the draft token
            ([[(5, 0.5), (runtime.n_vocab, 0.5)], [(6, 1.0)]], InvalidToken),  # no such id
        ]
        for probs, error in bad:
            (answer,) = await drive(
                scheduler, scheduler.verify(request.model_copy(update={"draft_probs": probs}))
            )
            assert isinstance(answer, error), (probs, answer)
        assert_consistent(runtime, engine, scheduler)
        # The session is untouched, random stream included: it answers the next round
        # exactly as its twin, which saw none of the bad requests.
        # Only rejection reads q; the others ignore a well-formed one, so the twin sends none.
        good = [[(5, 0.7), (9, 0.3)], [(6, 1.0)]]
        twin_probs = good if strategy == "rejection" else None
        answers = await drive(
            scheduler,
            scheduler.verify(request.model_copy(update={"draft_probs": good})),
            scheduler.verify(
                verify_request(twin, [5, 6]).model_copy(update={"draft_probs": twin_probs})
            ),
        )
        assert answers[0].model_dump(exclude={"timings"}) == answers[1].model_dump(
            exclude={"timings"}
        )

    run(scenario())
    assert_consistent(runtime, engine, scheduler)


# -- what no request should ever meet, handled anyway -----------------------------------


def test_metrics_that_fail_never_cost_a_round_its_answer(monkeypatch):
    runtime, engine, scheduler = build()
    monkeypatch.setattr(scheduler.metrics, "observe_pass", _raise)

    async def scenario():
        session = await open_session(scheduler, "counted or not")
        expected = runtime.reference_greedy(session["ids"], 4)
        assert await continue_alone(scheduler, session, 4) == expected

    run(scenario())
    assert_consistent(runtime, engine, scheduler)


def test_the_engine_thread_survives_a_failing_sweep(monkeypatch):
    runtime = FakeRuntime()
    engine = make_engine(runtime, max_draft=MAX_DRAFT)
    monkeypatch.setattr(engine.sessions, "expire", _raise)
    scheduler = BatchScheduler(
        engine,
        VerifierMetrics(4, MAX_DRAFT),
        core_settings(max_queue=8, session_ttl_s=1.0),
    )
    scheduler.start()

    async def scenario():
        scheduler._last_sweep = float("-inf")  # the next pass sweeps, and the sweep fails
        prefill = await asyncio.wait_for(prefilled(scheduler, PrefillRequest(prompt="a")), 60)
        scheduler._last_sweep = float("-inf")
        request = VerifyRequest(session_id=prefill.session_id, n_past=prefill.total_tokens)
        answer = await asyncio.wait_for(scheduler.verify(request), 60)
        assert answer.tokens == runtime.reference_greedy(prefill.prompt_ids, 1)

    try:
        run(scenario())
    finally:
        scheduler.close()
    assert runtime.closed


def test_stopping_fails_what_is_still_queued_and_undoes_it():
    runtime, engine, scheduler = build()

    async def scenario():
        session = await open_session(scheduler, "left behind")
        task = asyncio.ensure_future(scheduler.verify(verify_request(session, [1, 2])))
        await asyncio.sleep(0)
        assert scheduler.queue_depth == 1
        scheduler.stop()  # no engine thread here: nothing ran the round
        (answer,) = await drive(scheduler, task)
        assert isinstance(answer, ServerFull)
        with pytest.raises(ServerFull):
            await scheduler.verify(verify_request(session, [1, 2]))

    run(scenario())
    assert_consistent(runtime, engine, scheduler)


# -- batch invariance ------------------------------------------------------------------


def test_the_probe_finds_a_batch_invariant_runtime_invariant():
    engine = make_engine(FakeRuntime(), max_draft=MAX_DRAFT)
    assert engine.invariance.batch_invariant
    assert engine.invariance.max_abs_diff == 0.0
    assert engine_info(engine).batch_invariant and engine_info(engine).strategies["greedy"]
    check_engine(engine)


def test_the_probe_decides_lossless_when_logits_depend_on_the_pass():
    runtime = FakeRuntime(kernel=switches_by_rows())
    engine = make_engine(runtime, max_draft=MAX_DRAFT, pin_shapes="off")
    assert not engine.invariance.batch_invariant
    info = engine_info(engine)
    assert info.batch_invariant is False and info.batch_max_diff > 0
    assert info.strategies["greedy"] is False and info.strategies["rejection"] is True
    prefill = engine.begin_prefill(PrefillRequest(prompt="abc"))
    (opened,) = engine.run([], [prefill]).results
    assert opened.response.lossless is False
    check_engine(engine)


def test_the_probe_leaves_its_sequences_empty():
    runtime = FakeRuntime()
    make_engine(runtime, max_draft=MAX_DRAFT)
    assert all(cells == [] for cells in runtime.cells.values())
    assert len(runtime.decodes) > 3  # it did decode, several ways


def test_compare_reports_the_largest_difference():
    from server.verifier.probe.round_probe import compare

    reference = np.zeros((3, 4), dtype=np.float32)
    same = reference.copy()
    shifted = reference.copy()
    shifted[1, 2] = 0.25
    assert compare(reference, [same]).batch_invariant
    report = compare(reference, [same, shifted])
    assert not report.batch_invariant and report.max_abs_diff == 0.25
    assert not report.argmax_agrees


def test_a_prompt_is_cut_at_the_same_places_however_busy_the_engine():
    """A chunk's length can change its numbers (llama.cpp's CPU kernels from 64 rows of
    one sequence on; the fake's from 12 here), so a prompt must be cut the same way
    whether it is alone or shares cycles with other sessions' rounds."""

    def chunks_and_answer(busy: bool):
        runtime = FakeRuntime(n_batch=64, kernel=switches_by_rows(seq_rows=12, pass_rows=999))
        engine = make_engine(runtime, max_draft=MAX_DRAFT, prompt_chunk=16)
        scheduler = stepped_scheduler(engine)

        async def scenario():
            others = [await open_session(scheduler, f"other {i}") for i in range(2)] if busy else []
            first = len(runtime.decodes)
            calls = [scheduler.verify(verify_request(o, [3, 4, 5])) for o in others]
            calls.insert(1 if busy else 0, prefilled(scheduler, PrefillRequest(prompt="y" * 40)))
            answers = await drive(scheduler, *calls)
            opened = answers[1 if busy else 0]
            seq = engine.session(opened.session_id).seq_id
            cuts = [
                n for n in (sum(e.seq_id == seq for e in d) for d in runtime.decodes[first:]) if n
            ]
            session = {"id": opened.session_id, "n_past": opened.total_tokens}
            return cuts, await continue_alone(scheduler, session, 6)

        return run(scenario())

    alone, busy = chunks_and_answer(False), chunks_and_answer(True)
    assert alone[0] == [16, 16, 8]
    assert busy == alone
