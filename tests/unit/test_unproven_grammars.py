"""A grammar whose end the check cannot prove (server/shared/grammar_ends.py, issue 64) is
accepted and bounded: its sessions generate at most VERIFIER_GRAMMAR_UNPROVEN_TOKENS, the
tokens of a reopened session's prompt counted; a round's draft is cut to what fits under
the bound (the answer's `draft_verified`), and a round once the session is at the bound is
refused (400 grammar_token_limit); a grammar proven to end has no bound but the context.
With a tokenizer of one token a byte, and a stand-in model: no model."""

from __future__ import annotations

import pytest

from server.shared.constraint import TokenLimitReached
from server.shared.grammars import GrammarLimits, Grammars
from server.shared.protocol import PrefillRequest, VerifyRequest, VerifyResponse
from server.verifier.decoding.checks import round_key
from server.verifier.decoding.decoding_rules import prepared_constraint
from server.verifier.decoding.jobs import Opened
from server.verifier.decoding.rounds import grammar_step
from server.verifier.errors import GrammarTokenLimit
from server.verifier.scheduling.cycle import CycleStep, Job
from tests.fixtures.byte_grammar import END, TOKENIZER
from tests.fixtures.fake_runtime import FakeRuntime
from tests.fixtures.invariants import check_engine
from tests.fixtures.stepped import make_engine
from tests.unit.test_cycle import open_session, round_job

# Its only end is through a rule the check does not read (llguidance's `%json`).
UNPROVEN = 'start: "a" start | tail\ntail: %json {"type": "string"}'
PROVEN = 'start: "a" start | "b"'


def grammars(unproven_tokens: int) -> Grammars:
    return Grammars(lambda: TOKENIZER, END + 1, GrammarLimits(unproven_tokens=unproven_tokens))


def test_a_grammar_whose_end_is_unproven_carries_the_bound_and_a_proven_one_none():
    shelf = grammars(5)
    assert shelf.constraint("lark", UNPROVEN, "k").token_limit == 5
    assert shelf.kept("lark", UNPROVEN, "k").token_limit == 5  # a copy, bounded alike
    assert shelf.constraint("lark", PROVEN, "k").token_limit is None
    assert grammars(0).constraint("lark", UNPROVEN, "k").token_limit is None  # 0: unbounded


def test_masks_stop_at_the_bound_and_an_undone_commit_gives_its_tokens_back():
    state = grammars(5).constraint("lark", UNPROVEN)
    a = ord("a")
    assert len(state.row_masks([a, a, a, a])) == 5  # 5 tokens at most: fits
    assert len(state.row_masks([a] * 7)) == 5  # the draft's first 4: what fits
    state.commit([a, a])
    undo = state.commit([a])
    assert state.generated == 3 and state.draft_room(4) == 1
    assert len(state.row_masks([a, a])) == 2  # the pending token's row and one draft's
    undo()
    assert len(state.row_masks([a, a])) == 3
    state.defer([a, a, a])  # a round's committed tokens count once committed
    with pytest.raises(TokenLimitReached, match="VERIFIER_GRAMMAR_UNPROVEN_TOKENS"):
        state.row_masks([])
    assert state.generated == 5 and state.failure is None  # a bound, not a failed grammar
    assert grammars(0).constraint("lark", UNPROVEN).draft_room(99) == 99  # unbounded


def test_the_bound_is_a_400_of_its_own_and_counts_a_reopened_sessions_tokens():
    shelf, a = grammars(4), ord("a")
    request = PrefillRequest(
        prompt_tokens=[1, a, a, a],
        generated_tokens=3,
        grammar={"kind": "lark", "source": UNPROVEN},
    )
    state = prepared_constraint(shelf, request, request.prompt_tokens)
    assert state is not None and state.generated == 3
    assert len(state.row_masks([a, a])) == 1  # the fourth, and no draft
    state.commit([a])
    with pytest.raises(GrammarTokenLimit) as refused:
        grammar_step(lambda: state.row_masks([]))
    assert refused.value.status_code == 400
    assert refused.value.error_type == "grammar_token_limit"


# Through the engine's cycle, with a stand-in model (tests/fixtures/fake_runtime.py, a
# vocabulary of 64 tokens): a grammar whose tokens are bytes below 64.
LOW_UNPROVEN = 'start: "0" start | tail\ntail: %json {"type": "string"}'
BOUND = 5


def bounded_cycle():
    runtime = FakeRuntime(n_seq_max=4, n_batch=64, n_ctx_per_seq=256)
    return CycleStep(make_engine(runtime, max_draft=8)), grammars(BOUND)


def open_bounded(cycle: CycleStep, shelf: Grammars) -> Opened:
    constraint = shelf.constraint("lark", LOW_UNPROVEN, "a")
    return open_session(cycle, "under a grammar", constraint=constraint)


def answer(cycle: CycleStep, job: Job):
    for _ in range(64):  # a chunk: one step a token
        answers = dict(cycle.step([job]).answers)
        if job in answers:
            return answers[job]
    raise AssertionError("the round was never answered")


def verifier_alone(cycle: CycleStep, shelf: Grammars) -> list[int]:
    """The tokens the verifier writes under the grammar, round by round without drafts,
    to the bound: then refused."""
    opened, tokens = open_bounded(cycle, shelf), []
    while isinstance(got := answer(cycle, round_job(opened, [])), VerifyResponse):
        tokens += got.tokens
    assert isinstance(got, GrammarTokenLimit) and len(tokens) == BOUND
    return tokens


def test_a_draft_past_the_bound_is_cut_to_what_fits_and_refused_only_at_the_bound():
    cycle, shelf = bounded_cycle()
    alone = verifier_alone(cycle, shelf)
    opened = open_bounded(cycle, shelf)
    # 8 drafts, the verifier's 5 tokens first: 4 fit (with the round's own token, 5).
    whole = answer(cycle, round_job(opened, [*alone, *alone[:3]]))
    assert isinstance(whole, VerifyResponse), whole
    assert whole.draft_verified == BOUND - 1 and whole.accepted_prefix_len == BOUND - 1
    assert whole.tokens == alone  # the cut lost nothing: the verifier's own tokens
    refused = answer(cycle, round_job(opened, alone[:1]))
    assert isinstance(refused, GrammarTokenLimit) and refused.status_code == 400
    check_engine(cycle.engine)


def test_a_round_below_the_bound_keeps_the_draft_that_fits():
    cycle, shelf = bounded_cycle()
    alone = verifier_alone(cycle, shelf)
    opened = open_bounded(cycle, shelf)
    first = answer(cycle, round_job(opened, alone[:2]))  # 3 of 5: uncut
    assert first.draft_verified is None and first.tokens == alone[:3]
    second = answer(cycle, round_job(opened, [*alone[3:], *alone[:3]]))  # 5 drafts, 1 fits
    assert second.draft_verified == 1 and second.tokens == alone[3:]
    check_engine(cycle.engine)


def test_a_chunk_stops_at_the_bound_with_the_verifiers_tokens():
    cycle, shelf = bounded_cycle()
    alone = verifier_alone(cycle, shelf)
    opened = open_bounded(cycle, shelf)
    request = VerifyRequest(
        session_id=opened.response.session_id, n_past=len(opened.session.tokens), chunk_tokens=20
    )
    chunk = answer(
        cycle, Job("a", request.session_id, request=request, round_key=round_key(request))
    )
    assert isinstance(chunk, VerifyResponse) and chunk.tokens == alone
    check_engine(cycle.engine)
