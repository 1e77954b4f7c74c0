"""A lookup's draft (prompt lookup, a suffix match: a copy of earlier text) is marked as
one on the wire (`draft_kind`), judged as any draft, and kept out of what the session's
acceptance is made from (a draft model's); its length still counts where a
draft's does (the last draft the advice grows from, the pool of its owner's rounds),
since its rows fill a pass alike."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from drafter.drafters.ngram import NgramDrafter
from drafter.speculative.candidates import Draft
from drafter.speculative.round_parts import verify_request
from server.shared.draft_gain import Acceptance
from server.shared.protocol import VerifyRequest
from server.verifier.decoding.advice import POOL_DECAY
from server.verifier.decoding.checks import round_key
from server.verifier.metrics import VerifierMetrics
from server.verifier.scheduling.cycle import Job
from tests.fixtures.invariants import check_engine
from tests.unit.test_cycle import build, open_session


def round_with(opened, draft: list[int], kind: str | None) -> Job:
    request = VerifyRequest(
        session_id=opened.response.session_id,
        n_past=len(opened.session.tokens),
        draft_tokens=draft,
        draft_kind=kind,
    )
    owner = opened.session.owner
    return Job(owner, request.session_id, request=request, round_key=round_key(request))


@pytest.mark.parametrize("kind", [None, "lookup"])
def test_a_lookups_round_is_judged_alike_and_leaves_the_sessions_acceptance(kind):
    runtime, cycle = build()
    engine = cycle.engine
    opened = open_session(cycle, "the same text, twice")
    expected = runtime.reference_greedy(opened.response.prompt_ids, 4)
    session = opened.session
    pool, copies, resyncs = engine.advisor.pool(session.owner), session.copies, session.resyncs
    step = cycle.step([round_with(opened, [expected[0], expected[1], 63], kind)])
    ((_, answer),) = step.answers
    assert answer.tokens == expected[:3] and answer.accepted_prefix_len == 2  # alike
    # Counted as any round's, and a lookup's counted apart too (its own metrics).
    assert step.rounds == [(3, 2)] and step.lookups == ([(3, 2)] if kind else [])
    metrics = VerifierMetrics(engine.n_seq, engine.max_draft)
    metrics.observe_step(step)
    sample = metrics.registry.get_sample_value
    assert sample("verifier_accepted_tokens_total") == 2
    assert sample("verifier_lookup_accepted_tokens_total") == (2 if kind else 0)
    assert sample("verifier_lookup_drafted_tokens_total") == (3 if kind else 0)
    if kind == "lookup":
        assert session.acceptance == Acceptance()
    else:
        assert session.acceptance == Acceptance().after(3, 2)
    # Either way its rows filled the pass: the advice grows from its length, and the pool
    # its owner's sessions' advice comes from counts it (the mark is only the client's word).
    assert session.last_draft == 3
    assert engine.advisor.pool(session.owner) == pool.after(3, 2, POOL_DECAY)
    assert (session.copies, session.resyncs) == (copies, resyncs)  # no copy of the verifier's
    check_engine(engine)


def test_lookups_after_a_model_round_keep_its_acceptance_and_grow_the_last_draft():
    runtime, cycle = build()
    opened = open_session(cycle, "the same text, twice")
    session = opened.session
    expected = runtime.reference_greedy(opened.response.prompt_ids, 12)
    cycle.step([round_with(opened, [expected[0], 63], None)])  # a model's draft: 1 of 2
    model_acceptance = Acceptance().after(2, 1)
    assert session.acceptance == model_acceptance and session.last_draft == 2
    ((_, answer),) = cycle.step([round_with(opened, expected[2:6], "lookup")]).answers
    assert answer.tokens == expected[2:7]  # all four accepted, the verifier's own after
    assert session.acceptance == model_acceptance and session.last_draft == 4
    check_engine(cycle.engine)


def test_a_replay_with_another_kind_is_answered_from_the_record_and_counted_once():
    runtime, cycle = build()
    opened = open_session(cycle, "the same text, twice")
    session = opened.session
    expected = runtime.reference_greedy(opened.response.prompt_ids, 4)
    first = round_with(opened, [expected[0], 63], None)
    ((_, answer),) = cycle.step([first]).answers
    acceptance, pool = session.acceptance, cycle.engine.advisor.pool(session.owner)
    again = VerifyRequest(**{**first.request.model_dump(), "draft_kind": "lookup"})
    assert round_key(again) == first.round_key  # the kind is no part of what a round is
    replay = Job("a", again.session_id, request=again, round_key=round_key(again))
    step = cycle.step([replay])
    assert step.replayed == 1 and step.answers[0][1] == answer
    assert session.acceptance == acceptance and cycle.engine.advisor.pool(session.owner) == pool
    check_engine(cycle.engine)


def test_draft_kind_takes_lookup_or_nothing():
    assert VerifyRequest(session_id="s", n_past=1, draft_kind="lookup").draft_kind == "lookup"
    with pytest.raises(ValidationError):
        VerifyRequest(session_id="s", n_past=1, draft_kind="model")
    # Left out where it is the default: a verifier that predates the field takes the round.
    body = VerifyRequest(session_id="s", n_past=1, draft_tokens=[5]).model_dump_json(
        exclude_none=True
    )
    assert "draft_kind" not in body


def test_the_drafter_marks_a_lookups_draft_and_keeps_the_mark():
    lookup = NgramDrafter(16, min_ngram=2).get_candidates([1, 2, 3, 1, 2], 2)
    assert lookup.tokens == [3, 1] and lookup.lookup
    assert lookup.first(1).lookup and lookup.first(1).tokens == [3]
    assert verify_request("s", [1, 2, 3, 1, 2], lookup, 1).draft_kind == "lookup"
    model = Draft([7, 8], [np.full(4, 0.25)] * 2)
    assert not model.lookup and verify_request("s", [1], model, 1).draft_kind is None
    # An empty lookup is a round without a draft: no kind to tell.
    assert verify_request("s", [1], Draft([], None, lookup=True), 4).draft_kind is None
    # A verifier whose /info does not say it takes the mark gets none.
    assert verify_request("s", [1, 2, 3, 1, 2], lookup, 1, mark_lookups=False).draft_kind is None


def test_one_owners_rejected_lookups_leave_another_owners_pool_and_advice():
    """Mallory's lookups, marked sure and rejected at once, count in her own pool only:
    alice's pool, what her advice is made from where sessions share passes, is as her own
    rounds left it."""
    runtime, cycle = build()
    engine = cycle.engine
    alice = open_session(cycle, "the same text, twice", owner="alice")
    mallory = open_session(cycle, "another text, twice", owner="mallory")
    expected = runtime.reference_greedy(alice.response.prompt_ids, 2)
    cycle.step([round_with(alice, [expected[0], 63], None)])
    pool = engine.advisor.pool("alice")
    for _ in range(3):
        job = round_with(mallory, [63, 63], "lookup")
        ((_, answer),) = cycle.step([job]).answers
        assert answer.accepted_prefix_len < 2
    assert engine.advisor.pool("alice") == pool
    assert engine.advisor.pool("mallory") != pool
    check_engine(engine)
