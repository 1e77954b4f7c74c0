"""A lookup's free drafts where `auto` has the draft model step aside (chunks of the
verifier's own tokens): sent while lookup rounds come at least as fast as chunks,
resting longer each time they lose. The gate alone, then the loop with a clock that moves
only as the fake verifier says, so every rate measured is fixed."""

from collections.abc import Sequence

from drafter.drafters.ngram import ModelWithLookup
from drafter.length.draft_length import LinkAwareLength
from drafter.length.lookup_gate import MIN_LOOKUP_TOKENS, REST_FIRST, LookupGate
from drafter.speculative.candidates import Draft, Drafter
from drafter.speculative.draft_readiness import catches_up
from drafter.speculative.loop import SpeculativeLoop
from drafter.speculative.warming import Warming
from tests.unit.test_chunk_probes import Clock, TimedDrafter, TimedVerifier
from tests.unit.test_loop import FakeVerifier, run, target_alone


def test_lookups_go_while_no_slower_than_chunks_and_rest_longer_each_time_they_lose():
    gate = LookupGate(maximum=8)
    assert not gate.wants(8)  # chunks not measured yet
    gate.answered(None, Draft([], None), 10, 0.1)  # chunks: 100 a second
    assert not gate.wants(MIN_LOOKUP_TOKENS - 1) and gate.wants(MIN_LOOKUP_TOKENS)
    for _ in range(2):  # lookups: 50 a second
        assert gate.wants(8)
        gate.answered(Draft([1] * 8, None), Draft([1] * 8, None), 2, 0.04)
    assert gate.resting
    rests = []
    for _ in range(3):
        chunks = 0
        while not gate.wants(8):
            gate.answered(None, Draft([], None), 10, 0.1)
            chunks += 1
        rests.append(chunks)
        gate.answered(Draft([1] * 8, None), Draft([1] * 8, None), 2, 0.04)  # loses again
    assert rests == [REST_FIRST, 2 * REST_FIRST, 4 * REST_FIRST]
    while not gate.wants(8):
        gate.answered(None, Draft([], None), 10, 0.1)
    for _ in range(3):  # copies that pay: 9 tokens in 0.05 s
        gate.answered(Draft([1] * 8, None), Draft([1] * 8, None), 9, 0.05)
    assert not gate.resting and gate.wants(8)
    # A try after a rest is judged on its own round, and a win starts rests afresh.
    losses = 0
    while not gate.resting:  # 20 a second, after the copies' rounds
        gate.answered(Draft([1] * 8, None), Draft([1] * 8, None), 1, 0.05)
        losses += 1
    assert losses <= 10
    for _ in range(REST_FIRST):
        assert not gate.wants(8)
        gate.answered(None, Draft([], None), 10, 0.1)
    gate.answered(Draft([1] * 8, None), Draft([1] * 8, None), 9, 0.05)  # its own: 180 a second
    assert not gate.resting
    while not gate.resting:
        gate.answered(Draft([1] * 8, None), Draft([1] * 8, None), 1, 0.05)
    rest = 0
    while not gate.wants(8):
        gate.answered(None, Draft([], None), 10, 0.1)
        rest += 1
    assert rest == REST_FIRST
    gate.answered(Draft([1] * 8, None), Draft([1] * 8, None), 9, 0.05)
    # The draft model's rounds are neither kind: not measured.
    gate.answered(None, Draft([1, 2], None), 1, 10.0)
    assert not gate.resting


class SpanLookup(Drafter):
    """A lookup that finds the target's next tokens in spans (a copied text) and nothing
    between them, or (`wrong`) finds a wrong continuation everywhere."""

    def __init__(self, verifier: FakeVerifier, wrong: bool = False):
        self.verifier = verifier
        self.wrong = wrong

    def get_candidates(self, committed: Sequence[int], k: int, stop=None) -> Draft:
        if self.wrong:
            return Draft([self.verifier.target(committed) + 100] * k, None)
        if (len(committed) // 40) % 2:  # every other 40 tokens
            return Draft([], None)
        context, draft = list(committed), []
        for _ in range(k):
            draft.append(self.verifier.target(context))
            context.append(draft[-1])
        return Draft(draft, None)


def gated_loop(wrong: bool):
    clock = Clock()
    verifier = TimedVerifier(clock, 1.0, advice=lambda i: 0)  # the model steps aside
    drafter = ModelWithLookup(SpanLookup(verifier, wrong), TimedDrafter(verifier, clock))
    length = LinkAwareLength(maximum=8, max_chunk=64, watched=True)
    loop = SpeculativeLoop(
        drafter, verifier, draft_n=length, n_ctx=10_000, clock=clock, lookups=LookupGate(8)
    )
    return loop


def test_copied_spans_are_drafted_where_the_model_steps_aside():
    loop = gated_loop(wrong=False)
    _, result = run(loop, [5, 6, 7], 300)
    assert result.tokens == target_alone([5, 6, 7], 300, FakeVerifier())
    stats = result.stats
    assert stats.lookup_rounds > 5 and stats.lookup_accepted == stats.lookup_drafted
    assert stats.drafted == stats.lookup_drafted  # the model drafted none
    assert stats.lookup_accepted + stats.lookup_rounds > 100  # tokens the copies brought


def test_lookups_that_lose_rest_and_the_output_is_unchanged():
    loop = gated_loop(wrong=True)
    _, result = run(loop, [5, 6, 7], 300)
    assert result.tokens == target_alone([5, 6, 7], 300, FakeVerifier())
    stats = result.stats
    assert stats.lookup_accepted == 0
    # Without the gate every round would carry the wrong lookup.
    assert 2 <= stats.lookup_rounds <= 5 < stats.rounds_without_draft


class RecordingLength(LinkAwareLength):
    """The model's draft length, recording the rounds it learns from."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.learned: list[tuple[int, int]] = []

    def update(self, drafted: int, accepted_prefix_len: int) -> None:
        self.learned.append((drafted, accepted_prefix_len))
        super().update(drafted, accepted_prefix_len)


class MarkedLookup(SpanLookup):
    """SpanLookup's spans, wrong ones, marked as a lookup's drafts are."""

    def get_candidates(self, committed: Sequence[int], k: int, stop=None) -> Draft:
        if (len(committed) // 40) % 2:
            return Draft([], None)
        return Draft([self.verifier.target(committed) + 100] * k, None, lookup=True)


def test_a_lookup_found_before_the_model_drafts_is_counted_as_one_and_not_learned_from():
    """Where the model drafts, a lookup's draft found first goes instead of the model's:
    its round is a lookup's (counted so), and the model's length, which prices the
    model's drafts, learns from the model's rounds alone (the lookups here all miss, the
    model's drafts never)."""
    clock = Clock()
    verifier = TimedVerifier(clock, 1.0, advice=lambda i: 4)  # the model drafts
    length = RecordingLength(maximum=8, max_chunk=64, watched=True)
    drafter = ModelWithLookup(MarkedLookup(verifier), TimedDrafter(verifier, clock))
    loop = SpeculativeLoop(drafter, verifier, draft_n=length, n_ctx=10_000, clock=clock)
    _, result = run(loop, [5, 6, 7], 300)
    assert result.tokens == target_alone([5, 6, 7], 300, FakeVerifier())
    stats = result.stats
    assert stats.lookup_rounds > 5 and stats.lookup_accepted == 0
    model_rounds = [(d, a) for d, a in length.learned if d]
    assert model_rounds and all(a == d for d, a in model_rounds)  # the lookups' misses not in
    assert stats.drafted - stats.lookup_drafted == sum(d for d, _ in model_rounds)


class NeverReady(Warming):
    """A draft model that is never ready: every round that would draft is held back."""

    def start(self, warm, prefill) -> None:
        pass

    def running(self) -> bool:
        return True

    def wait(self) -> None:
        pass

    def catch_up(self, drafter, committed, stop=None) -> bool:
        return False


def test_a_round_held_back_for_the_draft_model_still_sends_a_lookups_draft():
    """Where the model would draft but is not ready, the round goes without the model's
    draft; a lookup needs no model, so its draft goes (a request the history holds is
    drafted from its first round, while the model catches up)."""
    clock = Clock()
    verifier = TimedVerifier(clock, 1.0, advice=lambda i: 4)  # the model would draft
    drafter = ModelWithLookup(SpanLookup(verifier), TimedDrafter(verifier, clock))
    length = LinkAwareLength(maximum=8, max_chunk=64, watched=True)
    loop = SpeculativeLoop(
        drafter, verifier, draft_n=length, n_ctx=10_000, clock=clock, lookups=LookupGate(8)
    )
    loop.warming = NeverReady()
    _, result = run(loop, [5, 6, 7], 300)
    assert result.tokens == target_alone([5, 6, 7], 300, FakeVerifier())
    stats = result.stats
    assert stats.lookup_rounds > 5 and stats.lookup_accepted == stats.lookup_drafted
    assert stats.drafted == stats.lookup_drafted  # the model, never ready, drafted none


def test_the_draft_model_catches_up_while_a_lookups_round_is_out():
    """A lookup's round leaves the model idle: behind, it catches up meanwhile, as in a
    round without a draft; not while a round carries its own draft."""
    length = LinkAwareLength(maximum=8, max_chunk=64)
    lookup, modelled = Draft([1, 2], None, lookup=True), Draft([1, 2], None)
    assert catches_up(length, True, lookup, left=100, chunk=1)
    assert catches_up(length, True, Draft([], None), left=100, chunk=1)
    assert not catches_up(length, True, modelled, left=100, chunk=1)
