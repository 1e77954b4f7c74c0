"""Rounds without a draft that ask for a chunk of the verifier's own tokens (k = 0
rounds): exactly the tokens the verifier alone decodes, one answer, replayable; and the
advice every answer carries (fake runtime, passes driven by hand)."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from server.shared.protocol import MAX_CHUNK_TOKENS, VerifyRequest
from server.verifier.scheduling.service import VerifierService
from tests.unit.test_engine_races import (
    MAX_DRAFT,
    assert_consistent,
    build,
    continue_alone,
    drive,
    open_session,
    run,
    verify_request,
)


def chunk_request(session: dict, n: int) -> VerifyRequest:
    return VerifyRequest(session_id=session["id"], n_past=session["n_past"], chunk_tokens=n)


def test_a_chunk_is_the_verifiers_own_tokens_in_one_answer():
    runtime, engine, scheduler = build()
    service = VerifierService(scheduler)

    async def scenario():
        session = await open_session(scheduler, "a chunk of tokens")
        bystander = await open_session(scheduler, "beside it")
        chunk, beside = await drive(
            scheduler,
            service.verify(chunk_request(session, 7), "anonymous"),
            scheduler.verify(verify_request(bystander, [])),
        )
        assert chunk.tokens == runtime.reference_greedy(session["ids"], 7)
        assert chunk.preds == chunk.tokens and chunk.accepted_prefix_len == 0
        assert chunk.total_tokens == session["n_past"] + 7
        assert chunk.timings.decoded_tokens == 7
        assert beside.tokens == runtime.reference_greedy(bystander["ids"], 1)
        session["n_past"] = chunk.total_tokens
        # Drafted rounds go on from there as from any round.
        following = await continue_alone(scheduler, session, 3)
        assert chunk.tokens + following == runtime.reference_greedy(session["ids"], 10)

    try:
        run(scenario())
    finally:
        service.close()
    assert_consistent(runtime, engine)


def test_a_replayed_chunk_gets_the_same_answer_and_commits_nothing():
    runtime, engine, scheduler = build()
    service = VerifierService(scheduler)

    async def scenario():
        session = await open_session(scheduler, "lost answers")
        request = chunk_request(session, 5)
        (lost,) = await drive(scheduler, service.verify(request, "anonymous"))
        (again,) = await drive(scheduler, service.verify(request, "anonymous"))
        assert again == lost
        assert len(engine.session(session["id"]).tokens) == lost.total_tokens
        session["n_past"] = lost.total_tokens
        (following,) = await drive(
            scheduler, service.verify(chunk_request(session, 5), "anonymous")
        )
        assert lost.tokens + following.tokens == runtime.reference_greedy(session["ids"], 10)

    try:
        run(scenario())
    finally:
        service.close()
    assert_consistent(runtime, engine)


def test_a_chunk_with_a_draft_or_past_the_limit_is_refused():
    with pytest.raises(ValidationError, match="without draft_tokens"):
        VerifyRequest(session_id="s", n_past=3, draft_tokens=[1], chunk_tokens=2)
    with pytest.raises(ValidationError):
        VerifyRequest(session_id="s", n_past=3, chunk_tokens=MAX_CHUNK_TOKENS + 1)
    VerifyRequest(session_id="s", n_past=3, draft_tokens=[1], chunk_tokens=1)


def test_every_answer_carries_an_advised_draft_length_within_the_limit():
    _, engine, scheduler = build()

    async def scenario():
        session = await open_session(scheduler, "advice")
        for _ in range(4):
            (answer,) = await drive(scheduler, scheduler.verify(verify_request(session, [5, 6])))
            assert answer.advised_draft is not None and 0 <= answer.advised_draft <= MAX_DRAFT
            session["n_past"] = answer.total_tokens
        return session["id"]

    session_id = run(scenario())
    # Its drafts counted: the prior (0.75) moved.
    assert engine.session(session_id).acceptance.rate != pytest.approx(0.75)


def test_a_chunk_sent_again_while_it_runs_gets_the_same_answer():
    """A retry of a chunk whose answer was lost on the way, arriving while the chunk's
    rounds still run: it waits for the chunk's answer, and nothing is committed twice."""
    runtime, engine, scheduler = build()
    service = VerifierService(scheduler)

    async def scenario():
        session = await open_session(scheduler, "retried while running")
        request = chunk_request(session, 6)
        running = asyncio.ensure_future(service.verify(request, "anonymous"))
        while len(engine.session(session["id"]).tokens) < session["n_past"] + 2:
            for _ in range(5):  # answers cross to their tasks in a few loop steps
                await asyncio.sleep(0)
            scheduler.run_step()
        assert not running.done()  # two of its rounds in: mid-chunk
        first, retry = await drive(scheduler, running, service.verify(request, "anonymous"))
        assert retry == first
        assert first.tokens == runtime.reference_greedy(session["ids"], 6)
        assert len(engine.session(session["id"]).tokens) == first.total_tokens

    try:
        run(scenario())
    finally:
        service.close()
    assert_consistent(runtime, engine)


def test_a_chunks_answer_is_advised_from_the_sessions_last_drafted_round(monkeypatch):
    """The advice grows at most to twice the last draft and one: rounds without a draft
    leave that draft as it was, so a probe after chunks is advised what drafting earned.
    A chunk is advised once, as it ends (its steps are not: nobody reads their advice)."""
    _, engine, scheduler = build()
    last_drafts, advised = [], []
    advise = engine.advisor.advise

    def recording(acceptance, max_draft, last_draft=0, owner=""):
        last_drafts.append(last_draft)
        advised.append(advise(acceptance, max_draft, last_draft, owner))
        return advised[-1]

    monkeypatch.setattr(engine.advisor, "advise", recording)
    service = VerifierService(scheduler)

    async def scenario():
        session = await open_session(scheduler, "drafts, then a chunk")
        (drafted,) = await drive(scheduler, scheduler.verify(verify_request(session, [5, 6, 7])))
        session["n_past"] = drafted.total_tokens
        request = chunk_request(session, 3)
        (answer,) = await drive(scheduler, service.verify(request, "anonymous"))
        assert answer.advised_draft == advised[-1] is not None  # the chunk's one advice
        (replayed,) = await drive(scheduler, service.verify(request, "anonymous"))
        assert replayed == answer  # a replay gets it too, advising nothing again

    try:
        run(scenario())
    finally:
        service.close()
    assert last_drafts[0] == 0  # the prompt's answer: nothing drafted yet
    assert last_drafts[1:] == [3, 3]  # the drafted round, then the chunk's one answer
