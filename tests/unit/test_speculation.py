"""Drafts made while a round is out, for the verifier's likeliest answers (fake drafter
and verifier from test_loop: no model, no HTTP). Whatever the cache holds, the output is
the verifier's own; what it saves is when drafts are made."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from drafter.speculative.candidates import Draft, Drafter
from drafter.speculative.loop import SpeculativeLoop
from drafter.speculative.speculation import SpeculationCache
from tests.unit.test_loop import FakeVerifier, GatedVerifier, NoisyDrafter, run, target_alone


def STILL() -> float:
    return 0.0


class RankingDrafter(NoisyDrafter):
    """Drafts the target's tokens, one in `wrong_every` wrong, and ranks answers: the
    verifier's real answer among its guesses when `knows` is true, never when false."""

    def __init__(self, verifier, wrong_every: int, knows: bool):
        super().__init__(verifier, wrong_every)
        self.knows = knows
        self.ranked = 0

    def likely_answers(self, committed, draft, limit) -> list[tuple[int, int]]:
        self.ranked += 1
        context, answers = list(committed), []
        for i, token in enumerate([*draft, None]):
            target = self.verifier.target(context)
            if token != target:  # the verifier's answer: i accepted, then its own token
                real = (i, target)
                break
            context.append(token)
        decoys = [(0, 999), (len(draft), 998)]
        answers = [decoys[0], real, decoys[1]] if self.knows else decoys
        return answers[:limit]


@pytest.mark.parametrize("wrong_every", [3, 5, 1000])
def test_when_the_answer_was_drafted_for_the_next_round_goes_at_once(wrong_every):
    verifier = GatedVerifier()
    drafter = RankingDrafter(verifier, wrong_every, knows=True)
    loop = verifier.gated(
        # A clock that stands still: no answer is ever outside the wait's time budget.
        SpeculativeLoop(drafter, verifier, draft_n=4, n_ctx=10_000, pipeline=True, clock=STILL)
    )
    _, result = run(loop, [5, 6, 7], 60)
    assert result.tokens == target_alone([5, 6, 7], 60, FakeVerifier())
    stats = result.stats
    # Every round drafted ahead for; the last one's answer ended the generation.
    assert stats.speculation_hits >= stats.rounds - 2
    assert stats.rounds_sent_at_once >= stats.rounds - 2
    assert stats.answers_per_round == pytest.approx(3.0, abs=0.5)
    assert stats.wasted_ahead > 0  # the decoys' drafts
    # The real answer is always the second likeliest: drafting for one would never hit.
    assert set(stats.answer_ranks) == {1}
    assert stats.hit_rate_within(1) == 0.0
    assert stats.hit_rate_within(2) == stats.speculation_hit_rate


def test_when_it_was_not_the_round_is_drafted_as_usual_and_the_output_is_the_same():
    verifier = GatedVerifier()
    drafter = RankingDrafter(verifier, 3, knows=False)
    loop = verifier.gated(
        SpeculativeLoop(drafter, verifier, draft_n=4, n_ctx=10_000, pipeline=True, clock=STILL)
    )
    _, result = run(loop, [5, 6, 7], 40)
    assert result.tokens == target_alone([5, 6, 7], 40, FakeVerifier())
    assert result.stats.speculation_hits == 0 and result.stats.rounds_sent_at_once == 0
    assert result.stats.answer_ranks == {}


class SampledDrafter(Drafter):
    """Drafts sampled tokens with their q rows, from a seeded stream."""

    def __init__(self, n_vocab: int = 8):
        self.rng = np.random.default_rng(3)
        self.n_vocab = n_vocab

    def get_candidates(self, committed: Sequence[int], k: int, stop=None) -> Draft:
        tokens, rows = [], []
        for _ in range(k):
            q = self.rng.dirichlet(np.ones(self.n_vocab))
            tokens.append(int(self.rng.choice(self.n_vocab, p=q)))
            rows.append(q)
        return Draft(tokens, rows)

    def likely_answers(self, committed, draft, limit):
        return [(len(draft), t) for t in range(limit)]


def test_a_cached_sampled_draft_carries_the_q_its_tokens_were_drawn_from():
    drafter = SampledDrafter()
    cache = SpeculationCache(drafter, max_branches=3)
    cache.prepare([1, 2], [4, 5], 3, stop=lambda: False)
    made = dict(cache._drafts)
    taken = cache.take(2, 1, 3)
    assert taken.tokens == made[(2, 1)].tokens
    for row, original in zip(taken.probs, made[(2, 1)].probs, strict=True):
        assert row is original  # the very distribution it was drawn from
    assert cache.take(2, 1, 3) is None  # used once; the cache empties on every answer


def test_a_draft_cut_short_by_the_answer_is_left_to_the_drafter_to_finish():
    calls = {"n": 0}

    def stop() -> bool:
        calls["n"] += 1
        return calls["n"] > 2  # the answer comes during the second branch

    drafter = SampledDrafter()
    original = drafter.get_candidates

    def short(committed, k, stop=None):
        return original(committed, 1 if committed[-1] == 1 else k)

    drafter.get_candidates = short
    cache = SpeculationCache(drafter, max_branches=3)
    cache.prepare([1, 2], [4], 3, stop=stop)
    assert set(cache._drafts) == {(1, 0), (1, 1)}
    assert cache.take(1, 1, 3) is None  # the last, short: the drafter continues it
    assert cache.counts.hits == 1 and cache.counts.sent_at_once == 0


def test_answers_are_drafted_for_only_while_the_expected_wait_leaves_time():
    now = {"t": 0.0}

    def clock() -> float:
        return now["t"]

    drafter = SampledDrafter()
    made = drafter.get_candidates

    def drafting(committed, k, stop=None):
        now["t"] += 0.010 * k  # 10 ms a token
        return made(committed, k)

    drafter.get_candidates = drafting
    cache = SpeculationCache(drafter, max_branches=4, clock=clock)
    # k = 3: each answer costs 40 ms by the estimate; 95 ms of wait leaves room for the
    # first (always drafted), the second (30 + 40 <= 95), not the third (60 + 40 > 95).
    cache.prepare([1, 2], [4, 5], 3, stop=lambda: False, wait_s=0.095, token_s=0.010)
    assert set(cache._drafts) == {(2, 0), (2, 1)}
    assert cache.counts.branches == 2


def test_an_answer_is_ranked_whether_or_not_there_was_time_to_draft_for_it():
    """The rank of each answer among the drafter's guesses is what a drafter that drafts
    for more of them at once (a batched decode on a GPU) would hit: counted even when
    the wait left time for the first only."""
    now = {"t": 0.0}
    drafter = SampledDrafter()
    made = drafter.get_candidates

    def drafting(committed, k, stop=None):
        now["t"] += 0.010 * k
        return made(committed, k)

    drafter.get_candidates = drafting
    cache = SpeculationCache(drafter, max_branches=4, clock=lambda: now["t"])
    cache.prepare([1, 2], [4, 5], 3, stop=lambda: False, wait_s=0.035, token_s=0.010)
    assert set(cache._drafts) == {(2, 0)}
    assert cache.take(2, 2, 3) is None  # the third likeliest: ranked, not drafted for
    cache.prepare([1, 2], [4, 5], 3, stop=lambda: False, wait_s=0.035, token_s=0.010)
    assert cache.take(2, 0, 3) is not None
    cache.prepare([1, 2], [4, 5], 3, stop=lambda: False, wait_s=0.035, token_s=0.010)
    assert cache.take(0, 7, 3) is None  # not among its guesses at all
    assert cache.counts.answer_ranks == {2: 1, 0: 1}
    assert cache.counts.hits == 1 and cache.counts.answered == 3


def test_only_the_round_drafted_for_is_looked_up():
    """An answer is looked up once, and only for the round the drafts were made for: a
    round sent with nothing drafted ahead (no room left, k 0) finds nothing from an
    earlier one and counts nothing."""
    cache = SpeculationCache(SampledDrafter(), max_branches=3)
    assert cache.take(2, 0, 3) is None  # nothing prepared yet
    cache.prepare([1, 2], [4, 5], 3, stop=lambda: False)
    cache.forget()  # the next round went out with nothing drafted for it
    assert cache.take(2, 0, 3) is None
    cache.prepare([1, 2], [4, 5], 0, stop=lambda: False)
    assert cache.take(2, 0, 3) is None
    assert cache.counts.answered == 0 and cache.counts.answer_ranks == {}
    cache.prepare([1, 2], [4, 5], 3, stop=lambda: False)
    assert cache.take(2, 0, 3) is not None
    assert cache.take(2, 0, 3) is None  # once
    assert cache.counts.answered == 1 and cache.counts.hits == 1


def test_a_drafter_that_cannot_rank_drafts_for_one_answer_and_ranks_only_it():
    class Unranked(SampledDrafter):
        def likely_answers(self, committed, draft, limit):
            return None  # as every drafter that does not declare it

    cache = SpeculationCache(Unranked(), max_branches=4)
    cache.prepare([1, 2], [4, 5], 3, stop=lambda: False)
    ((answer, made),) = cache._drafts.items()
    assert answer[0] == 2 and len(made.tokens) == 3  # all accepted, then its own guess
    assert cache.take(*answer, 3) is not None
    cache.prepare([1, 2], [4, 5], 3, stop=lambda: False)
    assert cache.take(0, 7, 3) is None
    assert cache.counts.answer_ranks == {0: 1} and cache.counts.answered == 2


def test_a_draft_made_ahead_by_a_lookup_is_still_marked_a_lookups():
    """The verifier keeps a lookup's outcome out of its advice (draft_kind): a draft made
    ahead, whole or cut short, keeps the mark its drafter gave it."""

    class LookupDrafter(SampledDrafter):
        def get_candidates(self, committed, k, stop=None) -> Draft:
            return super().get_candidates(committed, k, stop)._replace(lookup=True)

    cache = SpeculationCache(LookupDrafter(), max_branches=3)
    cache.prepare([1, 2], [4, 5], 3, stop=lambda: False)
    taken = cache.take(2, 1, 3)
    assert taken.tokens and taken.lookup and taken.first(1).lookup
