"""Passes shared fairly: where rounds of more than one API key share a step, each
client's draft is cut to the draft its session is advised, so one key's long drafts do
not widen the pass another key's round waits for. The answer is the verifier's either
way (a prefix of a draft is judged as the whole is), and says what it verified."""

from __future__ import annotations

import pytest

from server.verifier.decoding.checks import round_key
from server.verifier.scheduling.cycle import CycleStep, Job
from tests.fixtures.fake_runtime import FakeRuntime
from tests.fixtures.invariants import check_engine
from tests.fixtures.stepped import make_engine
from tests.unit.test_cycle import open_session, round_job


@pytest.fixture
def cycle(monkeypatch) -> CycleStep:
    runtime = FakeRuntime(n_seq_max=4, n_batch=128, n_ctx_per_seq=256)
    cycle = CycleStep(make_engine(runtime, max_draft=16))
    # The advisor is tested on its own (test_advice.py); here, the advice it gives.
    monkeypatch.setattr(cycle.engine.advisor, "advise", lambda *args, **kwargs: 1)
    return cycle


def sessions(cycle: CycleStep, *owners: str):
    runtime = cycle.engine.runtime
    opened = [open_session(cycle, f"text of {owner} {i}", owner) for i, owner in enumerate(owners)]
    expected = [runtime.reference_greedy(o.response.prompt_ids, 9) for o in opened]
    return opened, expected


def test_one_keys_long_draft_is_cut_to_its_advice_beside_another_keys_round(cycle):
    (alice, mallory), (alice_next, mallory_next) = sessions(cycle, "alice", "mallory")
    alice_job = round_job(alice, alice_next[:1], "alice")
    mallory_job = round_job(mallory, mallory_next[:8], "mallory")  # all right, 8 long
    answers = dict(cycle.step([alice_job, mallory_job]).answers)
    cut = answers[mallory_job]
    assert cut.draft_verified == 1 and cut.accepted_prefix_len == 1
    assert cut.tokens == mallory_next[:2]  # the verifier's own tokens, as without the cut
    assert answers[alice_job].draft_verified is None
    assert answers[alice_job].tokens == alice_next[:2]
    # A duplicate of the cut round gets that round's own answer.
    request = mallory_job.request
    again = Job("mallory", request.session_id, request=request, round_key=round_key(request))
    ((_, replayed),) = cycle.step([again]).answers
    assert replayed == cut
    check_engine(cycle.engine)


def test_alone_or_among_its_own_a_keys_draft_is_verified_whole(cycle):
    (mallory,), (expected,) = sessions(cycle, "mallory")
    ((_, alone),) = cycle.step([round_job(mallory, expected[:8], "mallory")]).answers
    assert alone.draft_verified is None and alone.accepted_prefix_len == 8
    (first, second), (one, two) = sessions(cycle, "team", "team")
    jobs = [round_job(first, one[:8], "team"), round_job(second, two[:8], "team")]
    assert all(a.accepted_prefix_len == 8 for _, a in cycle.step(jobs).answers)
    check_engine(cycle.engine)


def test_no_cut_while_the_advice_is_unknown(cycle, monkeypatch):
    monkeypatch.setattr(cycle.engine.advisor, "advise", lambda *args, **kwargs: None)
    (alice, mallory), (alice_next, mallory_next) = sessions(cycle, "alice", "mallory")
    jobs = [
        round_job(alice, alice_next[:1], "alice"),
        round_job(mallory, mallory_next[:8], "mallory"),
    ]
    answers = [a for _, a in cycle.step(jobs).answers]
    assert [a.draft_verified for a in answers] == [None, None]
    assert sorted(a.accepted_prefix_len for a in answers) == [1, 8]
