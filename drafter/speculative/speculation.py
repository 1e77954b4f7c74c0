"""Drafts made while a round is out, one for each of the verifier's likeliest answers.

The verifier answers a round of k draft tokens with one of few outcomes: it keeps the
first n of them (n in 0..k) and adds one token t of its own (its correction, or after all
k its bonus token). While the round travels and is verified, the drafter drafts the next
round for the likeliest (n, t), most probable first (the draft model ranks them with its
own probabilities: `likely_answers`), until the answer arrives. If the answer is one of
them, the next round goes out at once with that draft; if not, it is drafted as usual.

A cached draft is exactly a draft: its tokens were drafted after exactly those committed
tokens, and with sampled drafts its q rows are the distributions its tokens were drawn
from, so what the verifier commits, and the sampling law, are the same with or without
the cache. A drafter that cannot rank answers (prompt lookup, drafting through text)
drafts ahead for one: every token accepted and its own guess of the bonus token (what
pipelining did before the cache). Seeded sampling never speculates (drafter/settings.py):
how far it gets depends on timing, and so would the random draws.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from drafter.speculative.candidates import Draft, Drafter


@dataclass
class SpeculationCounts:
    rounds: int = 0  # rounds during which drafts were made ahead
    answered: int = 0  # of those, rounds whose answer was looked up (not the last, an EOS)
    branches: int = 0  # (n, t) answers a draft was made for
    hits: int = 0  # answers found in the cache
    sent_at_once: int = 0  # of those, drafts long enough to send with no drafting
    drafted: int = 0  # tokens drafted ahead
    used: int = 0  # of those, tokens sent
    # Rounds whose answer was the r-th likeliest the drafter ranked (r from 0), drafted
    # for or not: the hit rate a drafter that drafts for r + 1 answers in the same time
    # (a batched decode on a GPU) would have.
    answer_ranks: dict[int, int] = field(default_factory=dict)


@dataclass
class SpeculationCache:
    drafter: Drafter
    max_branches: int = 4
    clock: Callable[[], float] = time.perf_counter
    counts: SpeculationCounts = field(default_factory=SpeculationCounts)
    _drafts: dict[tuple[int, int], Draft] = field(default_factory=dict)
    _last: tuple[int, int] | None = None  # the branch drafted last (the drafter's own state)
    _ranked: list[tuple[int, int]] = field(default_factory=list)  # this round's, likeliest first
    _prepared: bool = False  # drafts were made for the round now out

    def prepare(
        self,
        committed: Sequence[int],
        draft: Sequence[int],
        k: int,
        stop: Callable[[], bool],
        wait_s: float = float("inf"),
        token_s: float = 0.0,
    ) -> None:
        """Draft `k` tokens ahead for the likeliest answers to `draft`, until `stop()`:
        another answer only while the wait expected (`wait_s`, learned from the recent
        rounds) leaves time for its `k` + 1 tokens at `token_s` each."""
        self.forget()
        if k <= 0:
            return
        began = self.clock()
        self.counts.rounds += 1
        self._prepared = True
        ranked = None
        if self.max_branches > 1:
            ranked = self.drafter.likely_answers(committed, draft, self.max_branches)
        if ranked is None:
            self._ahead_for_all_accepted(committed, draft, k, stop)
            return
        self._ranked = list(ranked)
        for n, (accepted, token) in enumerate(self._ranked):
            spent = self.clock() - began
            if stop() or (n and spent + (k + 1) * token_s > wait_s):
                return
            branch = [*committed, *draft[:accepted], token]
            made = self.drafter.get_candidates(branch, k, stop=stop)
            self._keep((accepted, token), made)

    def take(self, accepted: int, token: int, k: int) -> Draft | None:
        """The draft made for this answer, at most `k` long; None on a miss (or when the
        draft must be finished: the drafter continues it cheaply, its state is there)."""
        if not self._prepared:
            return None
        answer, ranked, drafts, last = (accepted, token), self._ranked, self._drafts, self._last
        self.forget()
        self.counts.answered += 1
        if answer in ranked:
            rank = ranked.index(answer)
            self.counts.answer_ranks[rank] = self.counts.answer_ranks.get(rank, 0) + 1
        made = drafts.get(answer)
        if made is None:
            return None
        self.counts.hits += 1
        if len(made.tokens) < k and answer == last:
            return None  # cut short by the answer: the drafter picks up where it was
        tokens = list(made.tokens[:k])
        probs = None if made.probs is None else list(made.probs[:k])
        self.counts.sent_at_once += 1
        self.counts.used += len(tokens)
        return Draft(tokens, probs, len(tokens), made.lookup)

    def forget(self) -> None:
        """Drop what was drafted ahead: before the next round's, or when a round goes out
        with nothing drafted for it (whatever is kept belongs to an earlier one)."""
        self._drafts = {}
        self._ranked = []
        self._last = None
        self._prepared = False

    def _ahead_for_all_accepted(
        self, committed: Sequence[int], draft: Sequence[int], k: int, stop: Callable[[], bool]
    ) -> None:
        ahead = self.drafter.get_candidates([*committed, *draft], k + 1, stop=stop)
        if not ahead.tokens:
            return
        guess, *rest = ahead.tokens
        probs = None if ahead.probs is None else list(ahead.probs[1:])
        self._ranked = [(len(draft), guess)]
        self._keep((len(draft), guess), Draft(rest, probs, lookup=ahead.lookup))

    def _keep(self, answer: tuple[int, int], made: Draft) -> None:
        self._drafts[answer] = made
        self._last = answer
        self.counts.branches += 1
        self.counts.drafted += len(made.tokens)
