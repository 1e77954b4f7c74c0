"""A lookup's draft sized by the verifier (draft_accept): the client sends its estimate of
how often the draft's tokens are accepted, the verifier verifies the part its cost of a
pass says pays, and where none pays the round is the chunk it asked for. On the fake
runtime: the tokens are the verifier's own whatever is verified, the answer says how much
was (`draft_verified`), a replay gets the same answer, and a malformed draft is refused
whole, never cut to fit. On the client: the suffix drafter's estimate by match length,
and the loop's view of a sized round."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from drafter.drafters.ngram import ModelWithLookup
from drafter.drafters.suffix import MATCH_PRIOR, MatchAcceptance, SuffixDrafter, SuffixHistory
from drafter.speculative.candidates import Draft, Drafter
from drafter.speculative.loop import _as_verified
from server.shared.protocol import (
    PrefillRequest,
    RoundTimings,
    Strategy,
    VerifyRequest,
    VerifyResponse,
)
from server.verifier.decoding.checks import round_key
from server.verifier.decoding.copy_draft import ChunkCopier
from server.verifier.errors import DraftTooLong
from server.verifier.scheduling.cycle import CycleStep, Job
from tests.fixtures.fake_runtime import FakeRuntime
from tests.fixtures.invariants import check_engine
from tests.fixtures.stepped import make_engine
from tests.unit.test_copy_draft import CpuLikeCost, RepeatingRuntime, Session
from tests.unit.test_cycle import open_session


def sized_job(
    opened, draft: list[int], accept: float, chunk: int | None = None, owner: str = "a"
) -> Job:
    """A round marked as a lookup the verifier sizes (draft_accept): a chunk's first step."""
    request = VerifyRequest(
        session_id=opened.response.session_id,
        n_past=len(opened.session.tokens),
        draft_tokens=draft,
        draft_kind="lookup",
        draft_accept=accept,
        chunk_tokens=chunk,
    )
    return Job(owner, request.session_id, request=request, round_key=round_key(request))


def answered(cycle: CycleStep, job: Job, copies: list | None = None) -> VerifyResponse:
    """`copies`: the verifier's own copies (drafted, accepted) its steps made, added to."""
    for _ in range(64):
        step = cycle.step([job])
        if copies is not None:
            copies += step.copies
        answers = dict(step.answers)
        if job in answers:
            return answers[job]
    raise AssertionError("never answered")


def build() -> tuple[FakeRuntime, CycleStep]:
    runtime = FakeRuntime(n_seq_max=4, n_batch=64, n_ctx_per_seq=256)
    engine = make_engine(runtime, max_draft=8, chunk_copy_ngram=0)  # no copies of its own
    engine.copier.pass_cost = CpuLikeCost()  # a pass of 5 rows costs twice one row
    return runtime, CycleStep(engine)


def test_the_verifier_verifies_what_pays_at_the_clients_estimate():
    copier = ChunkCopier(12, 8, 1000, CpuLikeCost())
    session = Session(list(range(2, 30)))

    def sized(accept: float | None, n: int = 8) -> int | None:
        request = VerifyRequest(
            session_id="s", n_past=28, draft_tokens=list(range(n)), draft_kind="lookup",
            draft_accept=accept,
        )  # fmt: skip
        return copier.size_lookup(session, request)

    assert sized(None) is None  # not asked to size
    assert sized(0.1) == 0  # seldom accepted: no row of it pays
    assert 0 < sized(0.6) < sized(0.99) <= 8  # the likelier, the longer
    assert sized(0.99, 3) == 3  # never more than drafted
    # Under a grammar its masks are computed for the draft sent: verified whole.
    assert copier.size_lookup(Session(list(range(2, 30)), constraint=object()), VerifyRequest(
        session_id="s", n_past=28, draft_tokens=[1, 2], draft_kind="lookup", draft_accept=0.0
    )) == 2  # fmt: skip


@pytest.mark.parametrize("accept", [0.99, 0.0])
def test_a_sized_lookup_is_the_verifiers_own_tokens_verified_in_part_or_a_chunk(accept):
    runtime, cycle = build()
    opened = open_session(cycle, "a prompt that does not repeat itself at all")
    prompt = opened.response.prompt_ids
    expected = runtime.reference_greedy(prompt, 8)
    draft = [*expected[:5], (expected[5] + 1) % runtime.n_vocab]  # right, then one wrong
    job = sized_job(opened, draft, accept, chunk=4)
    answer = answered(cycle, job)
    assert answer.tokens == expected[: len(answer.tokens)]
    if accept:
        # Verified in part or whole; the round is that draft's alone (no chunk after it).
        assert 0 < answer.draft_verified <= 6
        assert answer.accepted_prefix_len == min(answer.draft_verified, 5)
        assert len(answer.tokens) == answer.accepted_prefix_len + 1
    else:  # none of it pays: the chunk asked for, a round without a draft
        assert answer.draft_verified == 0 and answer.accepted_prefix_len == 0
        assert answer.tokens == expected[:4] and answer.preds == answer.tokens
    assert answer.total_tokens == len(opened.session.tokens) == len(prompt) + len(answer.tokens)
    again = Job(job.owner, job.session_id, request=job.request, round_key=job.round_key)
    assert cycle.step([again]).answers == [(again, answer)]  # a replay gets the same
    check_engine(cycle.engine)


def test_the_verifiers_own_copy_goes_only_where_no_part_of_the_lookup_pays():
    runtime = RepeatingRuntime(n_seq_max=4, n_batch=64, n_ctx_per_seq=256)
    engine = make_engine(runtime, max_draft=8)  # copies of its own on
    engine.copier.pass_cost = CpuLikeCost()
    cycle = CycleStep(engine)
    passage = random.Random(9).sample(range(2, 60), 30)
    prompt = [*passage, *passage[:14]]  # the passage again: a copy of its own to make
    opened = open_tokens(cycle, prompt)
    expected = runtime.reference_greedy(prompt, 8)
    copies: list = []
    likely = answered(cycle, sized_job(opened, expected[:4], 0.99, chunk=6), copies)
    assert likely.draft_verified > 0 and likely.accepted_prefix_len == likely.draft_verified
    assert likely.tokens == expected[: likely.draft_verified + 1]
    assert copies == []  # the client's lookup paid: no copy of the verifier's instead
    unlikely = answered(cycle, sized_job(opened, [1, 1, 1], 0.0, chunk=6), copies)
    assert unlikely.draft_verified == 0 and unlikely.accepted_prefix_len == 0
    assert copies  # no part of it paid: the chunk, with the verifier's own copies
    done = len(likely.tokens)
    assert unlikely.tokens == runtime.reference_greedy(prompt, done + 6)[done:]
    check_engine(engine)


def open_tokens(cycle: CycleStep, prompt: list[int]):
    job = Job("a", None, request=PrefillRequest(prompt_tokens=prompt, add_bos=False))
    while not (answers := dict(cycle.step([job]).answers)):
        pass
    return answers[job]


def test_a_sized_lookup_without_a_chunk_is_one_token_where_none_of_it_pays():
    runtime, cycle = build()
    opened = open_session(cycle, "another prompt of its own")
    expected = runtime.reference_greedy(opened.response.prompt_ids, 2)
    answer = answered(cycle, sized_job(opened, expected[:2], 0.0))
    assert answer.draft_verified == 0 and answer.tokens == expected[:1]


def test_a_draft_too_long_is_refused_whole_not_cut_to_fit():
    _, cycle = build()
    opened = open_session(cycle, "a prompt")
    answer = answered(cycle, sized_job(opened, list(range(2, 12)), 0.99))  # 10 > max_draft 8
    assert isinstance(answer, DraftTooLong)
    check_engine(cycle.engine)


def test_draft_accept_is_a_lookups_and_only_it_goes_with_a_chunk():
    base = {"session_id": "s", "n_past": 3, "draft_tokens": [1, 2]}
    with pytest.raises(ValidationError, match="draft_accept is for a draft of draft_kind"):
        VerifyRequest(**base, draft_accept=0.5)
    with pytest.raises(ValidationError, match="chunk_tokens above 1"):
        VerifyRequest(**base, draft_kind="lookup", chunk_tokens=4)
    with pytest.raises(ValidationError):
        VerifyRequest(**base, draft_kind="lookup", draft_accept=1.5)
    ok = VerifyRequest(**base, draft_kind="lookup", draft_accept=0.5, chunk_tokens=4)
    assert round_key(ok) != round_key(ok.model_copy(update={"draft_accept": 0.6}))


def test_each_match_length_learns_its_own_acceptance():
    acceptance = MatchAcceptance()
    assert acceptance.rate(3) == acceptance.rate(40) == MATCH_PRIOR.rate
    assert acceptance.band(2) == acceptance.band(3) == 3 and acceptance.band(5) == 4
    assert acceptance.band(100) == 21
    for _ in range(6):
        acceptance.answered(3, 6, 0)  # short matches missed at once
        acceptance.answered(30, 8, 8)  # long ones taken whole
    assert acceptance.rate(3) < 0.3 < 0.9 < acceptance.rate(30)
    assert acceptance.rate(9) == MATCH_PRIOR.rate  # a band of its own, not yet seen
    # A band the verifier verifies none of drifts back toward the prior: tried again.
    poor, rates = acceptance.rate(3), []
    for _ in range(30):
        acceptance.answered(3, 0, 0)
        rates.append(acceptance.rate(3))
    assert poor < rates[0] and rates == sorted(rates) and rates[-1] > 0.8


def test_the_suffix_drafter_sends_its_estimate_only_to_a_verifier_that_sizes():
    history = SuffixHistory(1000)
    history.add([1, 2, 3, 4, 5, 6, 7, 8, 9])
    sized = SuffixDrafter(32, history, sized=True)
    draft = sized.get_candidates([0, 1, 2, 3, 4], 4)
    assert draft.tokens == [5, 6, 7, 8] and draft.lookup and draft.match == 4
    assert draft.accept == MATCH_PRIOR.rate
    assert SuffixDrafter(32, history).get_candidates([0, 1, 2, 3, 4], 4).accept is None
    sized.answered(draft, 2, 0)  # what the verifier verified and accepted of it
    assert history.acceptance.rate(4) < MATCH_PRIOR.rate
    assert sized.get_candidates([0, 1, 2, 3, 4], 4).accept == history.acceptance.rate(4)
    # The model behind a lookup: the lookup's rounds teach the lookup.
    combined = ModelWithLookup(sized, Drafter())
    before = history.acceptance.rate(4)
    combined.answered(draft, 4, 4)
    assert history.acceptance.rate(4) > before


def verdict(tokens: list[int], accepted: int, verified: int | None) -> VerifyResponse:
    return VerifyResponse(
        accepted_prefix_len=accepted, tokens=tokens, preds=tokens, total_tokens=10, eos=False,
        strategy=Strategy.greedy, lossless=True, draft_verified=verified,
        timings=RoundTimings(decode_ms=1.0, decoded_tokens=1),
    )  # fmt: skip


class Learning(Drafter):
    def __init__(self) -> None:
        self.seen: list[tuple[list[int], int, int]] = []

    def answered(self, draft: Draft, verified: int, accepted_prefix_len: int) -> None:
        self.seen.append((draft.tokens, verified, accepted_prefix_len))


def test_the_loop_counts_a_sized_round_as_what_was_verified():
    drafter, lookup = Learning(), Draft([5, 6, 7, 8], None, lookup=True, accept=0.9, match=4)
    draft, looked_up = _as_verified(drafter, lookup, lookup, verdict([5, 6, 9], 2, 3))
    assert draft.tokens == [5, 6, 7] and looked_up == draft and draft.accept == 0.9
    draft, looked_up = _as_verified(drafter, lookup, lookup, verdict([1, 2, 3], 0, 0))
    assert draft == Draft([], None) and looked_up is None  # a chunk's round, of no kind
    draft, looked_up = _as_verified(drafter, lookup, None, verdict([5, 6, 7, 8, 9], 4, None))
    assert draft == lookup and looked_up is None  # not sized: the draft as sent
    assert drafter.seen == [([5, 6, 7, 8], 3, 2), ([5, 6, 7, 8], 0, 0), ([5, 6, 7, 8], 4, 4)]
    _as_verified(drafter, Draft([], None), None, verdict([1, 2], 0, None))
    assert len(drafter.seen) == 3  # a round without a draft teaches a drafter nothing


def test_a_draft_without_the_probabilities_rejection_needs_is_refused_however_sized():
    from server.shared.protocol import SamplingParams
    from server.verifier.errors import InvalidDraftProbs

    _, cycle = build()
    job = Job("a", None, request=PrefillRequest(
        prompt="sampled", sampling=SamplingParams(temperature=0.8, seed=1), strategy="rejection"
    ))  # fmt: skip
    while not (answers := dict(cycle.step([job]).answers)):
        pass
    opened = answers[job]
    for accept in (0.0, 0.99):  # none of it verified, or some: refused either way
        assert isinstance(answered(cycle, sized_job(opened, [5, 6], accept)), InvalidDraftProbs)
    check_engine(cycle.engine)
