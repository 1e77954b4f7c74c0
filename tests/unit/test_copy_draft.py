"""Copies inside a chunk (server/verifier/copy_draft.py): the lookup against brute force,
the cost model's call, and on the fake runtime a chunk over a session's repeated text
that comes in fewer passes with exactly the verifier's own tokens."""

from __future__ import annotations

import random

from server.shared.draft_gain import Acceptance
from server.shared.protocol import PrefillRequest, Strategy, VerifyRequest
from server.verifier.checks import round_key
from server.verifier.copy_draft import COPY_PRIOR, ChunkCopier, copy_draft, copy_length
from server.verifier.cycle import CycleStep, Job
from tests.fixtures.fake_runtime import FakeRuntime
from tests.fixtures.invariants import check_engine
from tests.fixtures.stepped import make_engine
from tests.unit.test_cycle import chunk_job, chunk_job_like


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
    assert copy_draft([1, 0, 0, 1, 0], 1, 1) == [1]  # bytes 01 00 00 00 00 ...: 00 at 1 skipped


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
    def __init__(self, tokens, strategy=Strategy.greedy, constraint=None):
        self.tokens, self.strategy, self.constraint = tokens, strategy, constraint
        self.copies = COPY_PRIOR


def test_no_copy_under_a_grammar_a_drafters_probabilities_or_with_copies_off():
    tokens = [*range(2, 30), *range(2, 20)]
    copier = ChunkCopier(12, 8, 1000, CpuLikeCost())
    copy = copier.for_step(Session(tokens), 20)  # as long as the cost model says
    assert len(copy) >= 2 and copy == list(range(20, 20 + len(copy)))
    assert len(copier.for_step(Session(tokens), 3)) <= 2  # within the chunk's last tokens
    assert copier.for_step(Session(tokens, constraint=object()), 20) == []
    assert copier.for_step(Session(tokens, strategy=Strategy.rejection), 20) == []
    assert copier.for_step(Session(tokens, strategy=Strategy.match), 20) != []
    assert ChunkCopier(0, 8, 1000, CpuLikeCost()).for_step(Session(tokens), 20) == []
    # Never past the context: a round needs a position for each draft token.
    assert ChunkCopier(12, 8, len(tokens) + 1, CpuLikeCost()).for_step(Session(tokens), 20) == [20]
    assert ChunkCopier(12, 8, len(tokens), CpuLikeCost()).for_step(Session(tokens), 20) == []


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
