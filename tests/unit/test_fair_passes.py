"""Passes shared fairly: while more than one API key is present on the verifier (a round
or a prompt of another key queued, or one seen lately), each client's draft is cut to
the draft its session is advised, so one key's long drafts do not widen the pass another
key's round shares or arrives during. Alone, a key's drafts are verified whole. The
answer is the verifier's either way (a prefix of a draft is judged as the whole is), and
says what it verified."""

from __future__ import annotations

import numpy as np
import pytest

from server.verifier.decoding.checks import round_key
from server.verifier.scheduling.cycle import CycleStep, Job
from server.verifier.scheduling.fair_share import (
    KeysPresent,
    shares_the_verifier,
    verified_length,
)
from tests.fixtures.fake_runtime import FakeRuntime
from tests.fixtures.invariants import check_engine
from tests.fixtures.stepped import core_settings, make_engine, stepped_scheduler
from tests.unit.test_cycle import open_session, prompt_job, round_job

WINDOW_S = 1.0  # how long a key counts as present after its last round or prompt


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def cycle(monkeypatch, clock) -> CycleStep:
    runtime = FakeRuntime(n_seq_max=4, n_batch=128, n_ctx_per_seq=256)
    present = KeysPresent(WINDOW_S, clock)
    cycle = CycleStep(make_engine(runtime, max_draft=16), present=present)
    # The advisor is tested on its own (test_advice.py); here, the advice it gives.
    monkeypatch.setattr(cycle.engine.advisor, "advise", lambda *args, **kwargs: 1)
    return cycle


def replay(job: Job) -> Job:
    """A duplicate of a round (a client's retry)."""
    request = job.request
    return Job(job.owner, request.session_id, request=request, round_key=round_key(request))


def sessions(cycle: CycleStep, *owners: str):
    runtime = cycle.engine.runtime
    opened = [open_session(cycle, f"text of {owner} {i}", owner) for i, owner in enumerate(owners)]
    expected = [runtime.reference_greedy(o.response.prompt_ids, 12) for o in opened]
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
    ((_, replayed),) = cycle.step([replay(mallory_job)]).answers
    assert replayed == cut
    check_engine(cycle.engine)


def test_alone_or_among_its_own_a_keys_draft_is_verified_whole(cycle, clock):
    (mallory,), (expected,) = sessions(cycle, "mallory")
    ((_, alone),) = cycle.step([round_job(mallory, expected[:8], "mallory")]).answers
    assert alone.draft_verified is None and alone.accepted_prefix_len == 8
    (first, second), (one, two) = sessions(cycle, "team", "team")
    clock.now += WINDOW_S  # mallory is gone
    jobs = [round_job(first, one[:8], "team"), round_job(second, two[:8], "team")]
    assert all(a.accepted_prefix_len == 8 for _, a in cycle.step(jobs).answers)
    check_engine(cycle.engine)


def test_a_keys_lone_round_is_cut_while_another_key_was_here_lately(cycle, clock):
    (alice, mallory), (alice_next, mallory_next) = sessions(cycle, "alice", "mallory")
    cycle.step([round_job(alice, alice_next[:1], "alice")])  # alice answered, drafting on
    clock.now += WINDOW_S / 2
    mallory_job = round_job(mallory, mallory_next[:8], "mallory")
    ((_, cut),) = cycle.step([mallory_job]).answers  # mallory's round alone in its step
    assert cut.draft_verified == 1 and cut.accepted_prefix_len == 1
    assert cut.tokens == mallory_next[:2]  # the verifier's own tokens, as without the cut
    ((_, replayed),) = cycle.step([replay(mallory_job)]).answers
    assert replayed == cut
    # Alice's last round is a window behind: mallory is alone, her draft verified whole.
    clock.now += WINDOW_S / 2
    ((_, whole),) = cycle.step([round_job(mallory, mallory_next[2:10], "mallory")]).answers
    assert whole.draft_verified is None and whole.accepted_prefix_len == 8
    assert whole.tokens == mallory_next[2:11]
    check_engine(cycle.engine)


class Script:
    """A grammar allowing one token at each position, in turn: row i of a round's masks
    is its state after the draft's first i tokens."""

    def __init__(self, tokens: list[int]):
        self.tokens, self.at = tokens, 0

    def row_masks(self, draft_tokens, row_budget_s=0.0):
        return np.array([[self.tokens[self.at + i]] for i in range(len(draft_tokens) + 1)])

    def apply_masks(self, logits, masks):
        assert len(masks) == len(logits)  # a row for each row decoded, the first ones
        out = np.full_like(logits, -np.inf)
        for row, allowed in enumerate(masks):
            out[row, allowed] = logits[row, allowed]
        return out

    def defer(self, tokens):
        self.at += len(tokens)
        return lambda: setattr(self, "at", self.at - len(tokens))

    @property
    def finished(self) -> bool:
        return False


def test_a_grammars_round_cut_keeps_its_masks_first_rows(cycle, clock):
    (alice, mallory), (alice_next, _) = sessions(cycle, "alice", "mallory")
    script = [3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23]
    mallory.session.constraint = Script(script)
    cycle.step([round_job(alice, alice_next[:1], "alice")])
    ((_, cut),) = cycle.step([round_job(mallory, script[:8], "mallory")]).answers
    assert cut.draft_verified == 1 and cut.tokens == script[:2]
    clock.now += WINDOW_S  # alice is gone
    ((_, whole),) = cycle.step([round_job(mallory, script[2:10], "mallory")]).answers
    assert whole.draft_verified is None and whole.tokens == script[2:11]
    check_engine(cycle.engine)


def test_a_keys_lone_round_is_cut_while_another_key_has_work_queued(cycle):
    (mallory,), (mallory_next,) = sessions(cycle, "mallory")
    newcomer = prompt_job("alice's first text", "alice")  # alice never seen before
    step = cycle.step([round_job(mallory, mallory_next[:8], "mallory"), newcomer])
    ((_, cut),) = step.answers  # the round's step: alice's prompt waits for the next
    assert [p.kind for p in step.passes] == ["rounds"]
    assert cut.draft_verified == 1 and cut.tokens == mallory_next[:2]
    check_engine(cycle.engine)


def test_with_no_window_only_keys_with_work_queued_are_present(monkeypatch, clock):
    runtime = FakeRuntime(n_seq_max=4, n_batch=128, n_ctx_per_seq=256)
    cycle = CycleStep(make_engine(runtime, max_draft=16), present=KeysPresent(0.0, clock))
    monkeypatch.setattr(cycle.engine.advisor, "advise", lambda *args, **kwargs: 1)
    (alice, mallory), (alice_next, mallory_next) = sessions(cycle, "alice", "mallory")
    cycle.step([round_job(alice, alice_next[:1], "alice")])  # at the same instant
    ((_, whole),) = cycle.step([round_job(mallory, mallory_next[:8], "mallory")]).answers
    assert whole.draft_verified is None and whole.accepted_prefix_len == 8


def test_keys_present_within_the_window_and_the_policy_around_them(clock):
    present = KeysPresent(WINDOW_S, clock)
    present.seen(["alice", "mallory"])
    clock.now += WINDOW_S / 2
    present.seen(["mallory"])
    assert present.recent() == {"alice", "mallory"}
    clock.now += WINDOW_S / 2
    assert present.recent() == {"mallory"}  # alice's last is a window behind
    clock.now += WINDOW_S
    assert present.recent() == set()
    assert shares_the_verifier(["mallory"], {"alice"})
    assert shares_the_verifier(["mallory", "alice"], set())
    assert not shares_the_verifier(["mallory", "mallory"], {"mallory"})
    assert [verified_length(8, advised) for advised in (None, 0, 1, 3, 8, 12)] == [
        8, 1, 1, 3, 8, 8,
    ]  # fmt: skip


def test_the_scheduler_counts_keys_present_for_the_setting():
    runtime = FakeRuntime(n_seq_max=4, n_batch=128, n_ctx_per_seq=256)
    scheduler = stepped_scheduler(make_engine(runtime))
    assert scheduler.cycle.present.window_s == core_settings().key_present_s > 0


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
