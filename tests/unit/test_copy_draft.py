"""Copies inside a chunk (server/verifier/decoding/copy_draft.py): the lookup against brute force,
the cost model's call, and on the fake runtime a chunk over a session's repeated text
that comes in fewer passes with exactly the verifier's own tokens."""

from __future__ import annotations

import random

from server.shared.draft_gain import Acceptance
from server.shared.protocol import PrefillRequest, Strategy, VerifyRequest
from server.verifier.decoding.checks import round_key
from server.verifier.decoding.copy_draft import (
    COPY_PRIOR,
    RESYNC_PRIOR,
    RESYNC_SLACK,
    ChunkCopier,
    Copy,
    copy_length,
    copy_source,
    resync_source,
)
from server.verifier.scheduling.cycle import CycleStep, Job
from tests.fixtures.fake_runtime import FakeRuntime
from tests.fixtures.invariants import check_engine
from tests.fixtures.stepped import make_engine
from tests.unit.test_cycle import chunk_job, chunk_job_like


def copy_draft(tokens: list[int], ngram: int, limit: int) -> list[int]:
    """Up to `limit` tokens from where copy_source says the copy starts."""
    start = copy_source(tokens, ngram) if limit > 0 else None
    return [] if start is None else tokens[start : start + limit]


def brute_force_copy(tokens: list[int], ngram: int, limit: int) -> list[int]:
    """Every earlier start of the last `ngram` tokens; the latest one's followers."""
    n = len(tokens)
    starts = [s for s in range(n - ngram) if tokens[s : s + ngram] == tokens[n - ngram :]]
    if limit <= 0 or ngram <= 0 or not starts:
        return []
    return tokens[max(starts) + ngram :][:limit]


def test_a_copy_is_what_followed_the_latest_earlier_occurrence_of_the_last_ngram():
    rng = random.Random(2)
    for _ in range(3000):
        tokens = [rng.randrange(rng.choice((2, 3, 8))) for _ in range(rng.randint(0, 40))]
        ngram, limit = rng.randint(0, 6), rng.randint(-1, 10)
        assert copy_draft(tokens, ngram, limit) == brute_force_copy(tokens, ngram, limit)
    assert copy_draft([5, 6, 7, 8, 5, 6], 2, 3) == [7, 8, 5]
    # Ids of several bytes, where a match of the bytes may start inside a token.
    for _ in range(2000):
        alphabet = [rng.choice((0, 1, 256, 65536, 65537, 151935)) for _ in range(3)]
        tokens = [rng.choice(alphabet) for _ in range(rng.randint(0, 60))]
        ngram, limit = rng.randint(1, 5), rng.randint(1, 10)
        assert copy_draft(tokens, ngram, limit) == brute_force_copy(tokens, ngram, limit)
    # The latest match of the bytes starts inside 256 (byte 10): skipped, as not a token.
    assert copy_draft([0, 9, 256, 65536, 0], 1, 1) == [9]


def cpu_like(rows: float) -> float:
    """A pass of 5 rows costs twice one row."""
    return 1.0 + 0.25 * (rows - 1)


def test_copies_are_drafted_while_they_pay_and_stop_once_they_miss():
    lengths, copies = [], COPY_PRIOR
    for _ in range(12):
        lengths.append(copy_length(8, copies, cpu_like, 1.0))
        copies = copies.after(8, 0)  # missed at once
    assert lengths[0] > 1 and lengths == sorted(lengths, reverse=True) and lengths[-1] == 0
    assert copy_length(8, COPY_PRIOR, None, 1.0) == 0  # a pass's cost not known yet
    assert copy_length(0, COPY_PRIOR, cpu_like, 1.0) == 0


class CpuLikeCost:
    sharing = 1.0

    def seconds(self):
        return cpu_like


class Session:
    def __init__(self, tokens, strategy=Strategy.greedy, constraint=None, copy_anchor=None):
        self.tokens, self.strategy, self.constraint = tokens, strategy, constraint
        self.copies, self.copy_anchor, self.resyncs = COPY_PRIOR, copy_anchor, RESYNC_PRIOR


def drafted(copier: ChunkCopier, session: Session, left: int) -> list[int]:
    copy = copier.for_step(session, left)
    return [] if copy is None else copy.tokens


def test_no_copy_under_a_grammar_a_drafters_probabilities_or_with_copies_off():
    tokens = [*range(2, 30), *range(2, 20)]
    copier = ChunkCopier(12, 8, 1000, CpuLikeCost())
    copy = drafted(copier, Session(tokens), 20)  # as long as the cost model says
    assert len(copy) >= 2 and copy == list(range(20, 20 + len(copy)))
    assert copier.for_step(Session(tokens), 20).source == 18  # where 20 follows the repeat
    assert len(drafted(copier, Session(tokens), 3)) <= 2  # within the chunk's last tokens
    assert drafted(copier, Session(tokens, constraint=object()), 20) == []
    assert drafted(copier, Session(tokens, strategy=Strategy.rejection), 20) == []
    assert drafted(copier, Session(tokens, strategy=Strategy.match), 20) != []
    assert drafted(ChunkCopier(0, 8, 1000, CpuLikeCost()), Session(tokens), 20) == []
    # Never past the context: a round needs a position for each draft token.
    assert drafted(ChunkCopier(12, 8, len(tokens) + 1, CpuLikeCost()), Session(tokens), 20) == [20]
    assert drafted(ChunkCopier(12, 8, len(tokens), CpuLikeCost()), Session(tokens), 20) == []


def test_sharing_a_pass_a_copy_must_pay_for_the_others_it_widens():
    """Only the copying session gains; every other session's row waits for the wider pass."""
    assert copy_length(8, COPY_PRIOR, cpu_like, 1.0) > 0
    assert copy_length(8, COPY_PRIOR, cpu_like, 8.0) == 0
    assert copy_length(8, COPY_PRIOR, lambda rows: 1.0, 8.0) > 0  # rows that cost nothing


class RepeatingRuntime(FakeRuntime):
    """A model that goes on with a repeat: after a token seen before, what followed it
    then is by far the likeliest (an induction head)."""

    def logits_after(self, prefix, kernels=()):
        row = super().logits_after(prefix, kernels)
        for i in range(len(prefix) - 2, -1, -1):
            if prefix[i] == prefix[-1]:
                row[prefix[i + 1]] += 20.0
                break
        return row


def chunk_over_a_repeat(ngram: int) -> tuple[list[int], int, CycleStep]:
    runtime = RepeatingRuntime(n_seq_max=4, n_batch=64, n_ctx_per_seq=256)
    engine = make_engine(runtime, max_draft=8, chunk_copy_ngram=ngram)
    engine.copier.pass_cost = CpuLikeCost()
    cycle = CycleStep(engine)
    passage = random.Random(9).sample(range(2, 60), 30)
    prompt = [*passage, *passage[:14]]  # the passage again: 16 tokens of it to come
    job = Job("a", None, request=PrefillRequest(prompt_tokens=prompt, add_bos=False))
    while not (answers := dict(cycle.step([job]).answers)):
        pass
    opened = answers[job]
    chunk, steps = chunk_job(opened, 14), 0
    while not (answers := dict(cycle.step([chunk]).answers)):
        steps += 1
    answer = answers[chunk]
    assert answer.tokens == runtime.reference_greedy(prompt, 14) == passage[14:28]
    assert answer.preds == answer.tokens and answer.accepted_prefix_len == 0
    assert answer.total_tokens == len(prompt) + 14 == len(opened.session.tokens)
    # The client's own drafts are judged as before: copies leave them alone.
    assert opened.session.acceptance == Acceptance() and opened.session.last_draft == 0
    again = chunk_job_like(chunk)
    assert cycle.step([again]).answers == [(again, answer)]  # a replay gets the same
    check_engine(engine)
    return answer.tokens, steps + 1, cycle


def test_a_chunk_one_copied_step_finishes_is_still_a_round_without_a_draft():
    runtime = RepeatingRuntime(n_seq_max=4, n_batch=64, n_ctx_per_seq=256)
    engine = make_engine(runtime, max_draft=8)
    engine.copier.pass_cost = CpuLikeCost()
    cycle = CycleStep(engine)
    passage = random.Random(9).sample(range(2, 60), 30)
    prompt = [*passage, *passage[:14]]
    job = Job("a", None, request=PrefillRequest(prompt_tokens=prompt, add_bos=False))
    while not (answers := dict(cycle.step([job]).answers)):
        pass
    opened = answers[job]
    request = VerifyRequest(
        session_id=opened.response.session_id,
        n_past=len(prompt),
        chunk_tokens=3,
        draft_probs=[],  # a client's empty list of probabilities: still a chunk
    )
    chunk = Job("a", request.session_id, request=request, round_key=round_key(request))
    ((_, answer),) = cycle.step([chunk]).answers  # one step: the pending token and a copy
    assert answer.tokens == passage[14:17] and answer.preds == answer.tokens
    assert answer.accepted_prefix_len == 0 and answer.timings.decoded_tokens == 3
    check_engine(engine)


def test_a_chunk_over_a_repeat_copies_it_in_fewer_passes_with_the_same_tokens():
    copied, copied_steps, cycle = chunk_over_a_repeat(12)
    plain, plain_steps, _ = chunk_over_a_repeat(0)
    assert copied == plain and plain_steps == 14
    assert copied_steps < plain_steps
    session = next(iter(cycle.engine.sessions._live.values()))
    assert session.copies.rate > COPY_PRIOR.rate  # every copied token accepted


def brute_force_resync(tokens: list[int], anchor: tuple[int, int], span: int) -> int | None:
    """Every occurrence of the text's last two tokens, kept where it starts near the anchor
    and ends before the anchor's position; the continuation of the first one."""
    source, position = anchor
    came = len(tokens) - position
    if not 0 < came <= span or source >= position or len(tokens) < 2:
        return None
    ends = [
        j + 2
        for j in range(len(tokens) - 1)
        if tokens[j : j + 2] == tokens[-2:]
        and source - 1 <= j <= source + came + RESYNC_SLACK
        and j + 2 <= position - 1
    ]
    return min(ends, default=None)


def test_a_resync_goes_on_just_past_where_the_text_left_the_source():
    rng = random.Random(5)
    for _ in range(3000):
        tokens = [rng.randrange(4) for _ in range(rng.randint(0, 50))]
        anchor = (rng.randint(0, len(tokens)), rng.randint(0, len(tokens)))
        span = rng.randint(0, 12)
        assert resync_source(tokens, anchor, span) == brute_force_resync(tokens, anchor, span)
    # "def foo(x): return foo(x)" sent back with foo renamed: the copy broke off at the
    # source's "foo" (index 1), where the text wrote "solve" (position 10).
    source = [10, 11, 12, 13, 14, 15, 11, 12, 13]  # def foo ( x ) return foo ( x
    assert resync_source([*source, 10, 99, 12], (1, 10), 32) is None  # "solve (": not there
    text = [*source, 10, 99, 12, 13]  # def solve ( x
    assert resync_source(text, (1, 10), 32) == 4  # "( x" found: goes on with ")"
    assert resync_source(text, None, 32) is None and resync_source(text, (1, 10), 0) is None
    assert resync_source([*text, *range(40, 80)], (1, 10), 32) is None  # too long ago


def test_a_copy_leaves_its_anchor_where_it_ends_and_a_resync_that_misses_drops_it():
    session = Session([])
    ChunkCopier.answered(session, Copy([5, 6, 7, 8], 20, False), first=50, accepted=2)
    assert session.copy_anchor == (22, 52)  # the source's third token, the text's 52nd
    ChunkCopier.answered(session, Copy([9, 9], 31, True), first=60, accepted=1)
    assert session.copy_anchor == (32, 61)
    ChunkCopier.answered(session, Copy([9, 9], 40, True), first=70, accepted=2)
    assert session.copy_anchor == (42, 72)  # all of it: the next resync goes on from its end
    ChunkCopier.answered(session, Copy([9, 9], 31, True), first=80, accepted=0)
    assert session.copy_anchor is None  # a guess that missed at once


def chunk_over_an_edited_repeat(resync: int) -> tuple[list[int], int, bool]:
    """A passage, then the passage again with one token changed near its start: the
    verifier's tokens and steps over the rest of the repeat, and whether any resync was
    judged (its acceptance counted apart from the copies')."""
    runtime = EditedRepeatRuntime(n_seq_max=4, n_batch=64, n_ctx_per_seq=256)
    engine = make_engine(runtime, max_draft=8, chunk_copy_resync=resync)
    engine.copier.pass_cost = CpuLikeCost()
    cycle = CycleStep(engine)
    prompt = [*PASSAGE, *PASSAGE[:14]]  # the repeat has begun: 14 tokens of it so far
    job = Job("a", None, request=PrefillRequest(prompt_tokens=prompt, add_bos=False))
    while not (answers := dict(cycle.step([job]).answers)):
        pass
    chunk, steps = chunk_job(answers[job], 14), 0
    while not (answers := dict(cycle.step([chunk]).answers)):
        steps += 1
    answer = answers[chunk]
    assert answer.tokens == runtime.reference_greedy(prompt, 14)
    check_engine(engine)
    session = engine.session(chunk.session_id, "a")
    assert session.acceptance == Acceptance()  # no client's drafts
    return answer.tokens, steps + 1, session.resyncs != RESYNC_PRIOR


PASSAGE = random.Random(9).sample(range(2, 60), 30)
EDIT_AT = 16  # the passage's 16th token comes out as RENAMED the second time
RENAMED = 61


class EditedRepeatRuntime(FakeRuntime):
    """After PASSAGE, writes it again, but RENAMED where it had its 16th token."""

    def logits_after(self, prefix, kernels=()):
        row = super().logits_after(prefix, kernels)
        i = len(prefix) - len(PASSAGE)
        if 0 <= i < len(PASSAGE) and list(prefix[: len(PASSAGE)]) == PASSAGE:
            row[RENAMED if i == EDIT_AT else PASSAGE[i]] += 100.0
        return row


def test_a_copy_goes_on_after_an_edit_in_the_repeat_with_the_same_tokens():
    resynced, resynced_steps, resyncs_judged = chunk_over_an_edited_repeat(32)
    plain, plain_steps, none_judged = chunk_over_an_edited_repeat(0)
    assert resynced == plain == [*PASSAGE[14:EDIT_AT], RENAMED, *PASSAGE[EDIT_AT + 1 : 28]]
    # The edit is the chunk's third token: the first step copies 4 (as many as the cost
    # model takes) and keeps 2, then the edit. Without a resync the other 11 come one a
    # step (no 12 tokens match again in this chunk); with one, the two plain steps after
    # the edit (the text's last two tokens hold the edit until then), then copies go on:
    # 3 steps for the last 9.
    assert plain_steps == 1 + 11
    assert resynced_steps == 1 + 2 + 3
    assert resyncs_judged and not none_judged  # resyncs counted apart, where there were any
