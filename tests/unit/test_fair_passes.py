"""Passes shared fairly: while more than one API key is present on the verifier (a round
or a prompt of another key being decoded, or one decoded lately; never a refusal, a
replay or a round waiting for its masks), each client's draft is cut to the draft its
session is advised, a lookup the verifier sizes too, so one key's long drafts do not
widen the pass another key's round shares or arrives during. Alone, a key's drafts are
verified whole. The answer is the verifier's either way (a prefix of a draft is judged
as the whole is), says what it verified, and a replay gets it again."""

from __future__ import annotations

import random

import numpy as np
import pytest

from server.shared.protocol import (
    PrefillRequest,
    SamplingParams,
    Strategy,
    VerifyRequest,
)
from server.verifier.decoding.checks import round_key
from server.verifier.errors import APIError
from server.verifier.scheduling.cycle import CycleStep, Job
from server.verifier.scheduling.fair_share import (
    KeysPresent,
    shares_the_verifier,
    verified_length,
)
from tests.fixtures.fake_runtime import FakeRuntime
from tests.fixtures.invariants import check_engine
from tests.fixtures.stepped import core_settings, make_engine, stepped_scheduler
from tests.unit.test_copy_draft import CpuLikeCost, RepeatingRuntime
from tests.unit.test_cycle import open_session, prompt_job, round_job
from tests.unit.test_lookup_sizing import answered, sized_job

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

    token_limit = None  # no bound on the tokens it allows

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
    script = [3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31]
    mallory.session.constraint = Script(script)
    cycle.step([round_job(alice, alice_next[:1], "alice")])
    ((_, cut),) = cycle.step([round_job(mallory, script[:8], "mallory")]).answers
    assert cut.draft_verified == 1 and cut.tokens == script[:2]
    # A lookup under a grammar is sized whole (its masks are the draft's): cut all the same.
    lookup = answered(cycle, lookup_job(mallory, script[2:10], "mallory", 1.0, 4))
    assert lookup.draft_verified == 1 and lookup.tokens == script[2:4]
    clock.now += WINDOW_S  # alice is gone
    ((_, whole),) = cycle.step([round_job(mallory, script[4:12], "mallory")]).answers
    assert whole.draft_verified is None and whole.tokens == script[4:13]
    check_engine(cycle.engine)


def lookup_job(opened, draft: list[int], owner: str, accept: float, chunk: int | None = None):
    return sized_job(opened, draft, accept, chunk, owner)


@pytest.mark.parametrize("chunk", [None, 4])
def test_a_lookup_the_verifier_sizes_is_cut_as_a_round_is(cycle, clock, chunk):
    cycle.engine.copier.pass_cost = CpuLikeCost()  # a long lookup sure to be accepted pays
    (alice, mallory), (alice_next, mallory_next) = sessions(cycle, "alice", "mallory")
    cycle.step([round_job(alice, alice_next[:1], "alice")])  # alice answered, drafting on
    mallory_job = lookup_job(mallory, mallory_next[:8], "mallory", 1.0, chunk)
    cut = answered(cycle, mallory_job)  # alone in its step, beside alice's presence
    assert cut.draft_verified == 1 and cut.accepted_prefix_len == 1
    assert cut.tokens == mallory_next[:2]  # the verifier's own tokens, as without the cut
    ((_, replayed),) = cycle.step([replay(mallory_job)]).answers
    assert replayed == cut
    clock.now += WINDOW_S  # alice is gone: verified as the verifier sizes it
    whole_job = lookup_job(mallory, mallory_next[2:10], "mallory", 1.0, chunk)
    sized = cycle.engine.copier.size_lookup(mallory.session, whole_job.request)
    assert sized > 1  # a cut would show
    whole = answered(cycle, whole_job)
    assert whole.draft_verified == whole.accepted_prefix_len == sized
    assert whole.tokens == mallory_next[2 : 2 + sized + 1]
    check_engine(cycle.engine)


def test_a_chunks_later_steps_and_the_verifiers_own_copies_are_not_cut(monkeypatch, clock):
    runtime = RepeatingRuntime(n_seq_max=4, n_batch=128, n_ctx_per_seq=256)
    engine = make_engine(runtime, max_draft=8)  # copies of its own on
    engine.copier.pass_cost = CpuLikeCost()
    cycle = CycleStep(engine, present=KeysPresent(WINDOW_S, clock))
    monkeypatch.setattr(engine.advisor, "advise", lambda *args, **kwargs: 1)
    alice = open_session(cycle, "alice's text", "alice")
    passage = random.Random(9).sample(range(2, 60), 30)
    prompt = [*passage, *passage[:14]]  # the passage again: a copy of its own to make
    mallory = answered(cycle, Job("mallory", None, request=PrefillRequest(prompt_tokens=prompt)))
    expected = runtime.reference_greedy(prompt, 6)
    cycle.step([round_job(alice, [], "alice")])  # alice answered, drafting on
    copies: list = []
    # None of the lookup pays: the chunk it asked for, with the verifier's own copies.
    chunk = answered(cycle, lookup_job(mallory, [1, 1, 1], "mallory", 0.0, 6), copies)
    assert chunk.draft_verified == 0 and chunk.tokens == expected
    assert max(drafted for drafted, _ in copies) > 1  # copies verified whole, not cut
    check_engine(engine)


def test_a_cut_leaves_sample_and_match_the_verifiers_own_draws(cycle):
    """Under `match` each token is its position's own draw from p, a draft token there or
    none: a seeded session's text is the same cut or whole (docs/sampling.md)."""

    def seeded(owner: str):
        sampling = SamplingParams(temperature=1.0, seed=7)
        request = PrefillRequest(prompt="one text", sampling=sampling, strategy=Strategy.match)
        return answered(cycle, Job(owner, None, request=request))

    own, whole, cut = seeded("mallory"), seeded("mallory"), seeded("mallory")
    draws: list[int] = []
    while len(draws) < 12:  # the verifier's own, a token a round
        draws += answered(cycle, round_job(own, [], "mallory")).tokens
    alone = answered(cycle, round_job(whole, draws[:8], "mallory"))
    assert alone.draft_verified is None and alone.tokens == draws[:9]
    seeded("alice")  # another key present
    first = answered(cycle, round_job(cut, draws[:8], "mallory"))
    second = answered(cycle, round_job(cut, draws[2:10], "mallory"))
    assert first.draft_verified == second.draft_verified == 1
    assert first.tokens + second.tokens == draws[:4]
    check_engine(cycle.engine)


def test_a_keys_lone_round_is_cut_while_another_key_has_work_queued(cycle):
    (mallory,), (mallory_next,) = sessions(cycle, "mallory")
    newcomer = prompt_job("alice's first text", "alice")  # alice never seen before
    step = cycle.step([round_job(mallory, mallory_next[:8], "mallory"), newcomer])
    ((_, cut),) = step.answers  # the round's step: alice's prompt waits for the next
    assert [p.kind for p in step.passes] == ["rounds"]
    assert cut.draft_verified == 1 and cut.tokens == mallory_next[:2]
    check_engine(cycle.engine)


class NeverDone:
    """Masks still being computed."""

    def done(self) -> bool:
        return False

    def result(self):
        raise AssertionError("not done")


def eves_round(session_id: str, n_past: int, draft: list[int]) -> Job:
    request = VerifyRequest(session_id=session_id, n_past=n_past, draft_tokens=draft)
    return Job("eve", session_id, request=request, round_key=round_key(request))


@pytest.mark.parametrize("eves", ["a replay", "404", "409", "400", "held for its masks"])
def test_refusals_replays_and_rounds_waiting_for_masks_make_no_key_present(
    monkeypatch, clock, eves
):
    runtime = FakeRuntime(n_seq_max=4, n_batch=128, n_ctx_per_seq=256)
    engine = make_engine(runtime, max_draft=16)
    cycle = CycleStep(engine, lambda owner, fn: NeverDone(), KeysPresent(WINDOW_S, clock))
    monkeypatch.setattr(engine.advisor, "advise", lambda *args, **kwargs: 1)
    (eve, held, mallory), _ = sessions(cycle, "eve", "eve", "mallory")
    eve_id, eve_n_past = eve.response.session_id, len(eve.session.tokens)
    answered = eves_round(eve_id, eve_n_past, [])
    cycle.step([answered])
    held.session.constraint = Script([3, 5, 7])  # its rounds' masks are never done
    clock.now += WINDOW_S  # eve's last round decoded is a window behind
    job = {
        "a replay": replay(answered),
        "404": eves_round("no such session", eve_n_past, []),
        "409": eves_round(eve_id, eve_n_past, [1]),  # n_past no longer the session's
        "400": eves_round(eve_id, len(eve.session.tokens), [runtime.n_vocab + 1]),
        "held for its masks": eves_round(held.response.session_id, len(held.session.tokens), [3]),
    }[eves]
    expected = runtime.reference_greedy(mallory.response.prompt_ids, 18)
    beside = round_job(mallory, expected[:8], "mallory")
    answers = dict(cycle.step([job, beside]).answers)
    if eves == "a replay":
        assert answers[job] == engine.session(eve_id, "eve").last_response
    elif eves == "held for its masks":
        assert job not in answers
    else:
        assert isinstance(answers[job], APIError) and answers[job].status_code == int(eves)
    after = round_job(mallory, expected[9:17], "mallory")  # in a step of its own, after
    answers |= dict(cycle.step([after]).answers)
    for mine in (beside, after):
        assert answers[mine].draft_verified is None and answers[mine].accepted_prefix_len == 8
    check_engine(engine)


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
