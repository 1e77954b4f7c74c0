"""The speculative loop against a fake verifier and fake drafters (no model, no HTTP)."""

import re
import sys
import threading
import time
from collections.abc import Sequence

import pytest

from drafter.errors import VerifierRejected
from drafter.length.chunk_pace import CHUNK_S_FIRST
from drafter.length.draft_length import LinkAwareLength
from drafter.length.plain_lengths import FixedLength
from drafter.speculative.candidates import Draft, Drafter
from drafter.speculative.loop import SpeculativeLoop
from server.shared.acceptance import accept_greedy
from server.shared.protocol import (
    SESSION_ID_PATTERN,
    PrefillRequest,
    PrefillResponse,
    RoundTimings,
    VerifyRequest,
    VerifyResponse,
)

EOS = 0


def target_next(committed: Sequence[int]) -> int:
    """A deterministic stand-in for the verifier's argmax."""
    return (committed[-1] * 7 + len(committed) * 3) % 50 + 1


class FakeVerifier:
    def __init__(self, eos_at: int | None = None, n_ctx: int = 10_000):
        self.committed: list[int] = []
        self.eos_at = eos_at  # generated-token index where the target says EOS
        self.n_ctx = n_ctx
        self.bytes_sent = self.bytes_received = 0
        self.deleted: list[str] = []
        self.rounds: list[int] = []
        self.prompt_len = 0

    def target(self, committed: Sequence[int]) -> int:
        if self.eos_at is not None and len(committed) - self.prompt_len == self.eos_at:
            return EOS
        return target_next(committed)

    def prefill(self, request: PrefillRequest) -> PrefillResponse:
        self.committed = list(request.prompt_tokens)
        self.prompt_len = len(self.committed)
        self.bytes_sent += 100
        return self.opened(request.session_id)

    def opened(self, session_id: str) -> PrefillResponse:
        return PrefillResponse(
            session_id=session_id,
            prompt_ids=self.committed,
            prompt_len=len(self.committed),
            total_tokens=len(self.committed),
            strategy="greedy",
            lossless=True,
        )

    def verify(self, request: VerifyRequest) -> VerifyResponse:
        assert request.n_past == len(self.committed), "drafter lost track of n_past"
        assert len(self.committed) + len(request.draft_tokens) <= self.n_ctx
        draft = request.draft_tokens
        targets = [self.target(self.committed + draft[:i]) for i in range(len(draft) + 1)]
        verdict = accept_greedy(draft, targets, lambda t: t == EOS)
        self.committed += verdict.tokens
        self.rounds.append(len(draft))
        self.bytes_sent += 10
        self.bytes_received += 20
        return VerifyResponse(
            accepted_prefix_len=verdict.accepted_prefix_len,
            tokens=verdict.tokens,
            preds=targets,
            total_tokens=len(self.committed),
            eos=verdict.eos,
            strategy="greedy",
            lossless=True,
            timings=RoundTimings(decode_ms=0.0, decoded_tokens=len(draft) + 1),
        )

    def delete_session(self, session_id: str) -> None:
        self.deleted.append(session_id)


class NoisyDrafter(Drafter):
    """Proposes the target's tokens but gets every `wrong_every`-th draft wrong."""

    def __init__(self, verifier: FakeVerifier, wrong_every: int):
        self.verifier = verifier
        self.wrong_every = wrong_every
        self.calls = 0

    def get_candidates(self, committed: Sequence[int], k: int, stop=None) -> Draft:
        draft: list[int] = []
        context = list(committed)
        for _ in range(k):
            self.calls += 1
            token = self.verifier.target(context)
            if self.calls % self.wrong_every == 0:
                token = token + 100
            draft.append(token)
            context.append(token)
        return Draft(draft, None)


def target_alone(prompt: list[int], n: int, verifier: FakeVerifier) -> list[int]:
    verifier.prompt_len = len(prompt)
    committed = list(prompt)
    for _ in range(n):
        token = verifier.target(committed)
        committed.append(token)
        if token == EOS:
            break
    return committed[len(prompt) :]


def run(loop: SpeculativeLoop, prompt: list[int], max_tokens: int):
    events = list(loop.run(PrefillRequest(prompt_tokens=prompt), max_tokens))
    return events, loop.result


@pytest.mark.parametrize("draft_n", [0, 1, 3, 4, 8])
@pytest.mark.parametrize("wrong_every", [1, 2, 5, 1000])
def test_output_equals_target_alone(draft_n, wrong_every):
    verifier = FakeVerifier()
    drafter = NoisyDrafter(verifier, wrong_every)
    loop = SpeculativeLoop(drafter, verifier, draft_n=draft_n, n_ctx=10_000)
    events, result = run(loop, [5, 6, 7], 37)
    assert result.tokens == target_alone([5, 6, 7], 37, FakeVerifier())
    assert len(result.tokens) == 37
    assert result.finish_reason == "max_tokens"
    assert sum(len(e.tokens) for e in events) == 37
    assert result.stats.rounds == len(events)
    assert result.stats.drafted == sum(len(e.draft_tokens) for e in events)
    assert result.stats.accepted == sum(e.accepted_prefix_len for e in events)
    assert len(verifier.deleted) == 1 and re.fullmatch(SESSION_ID_PATTERN, verifier.deleted[0])


def test_perfect_drafter_commits_k_plus_one_per_round():
    verifier = FakeVerifier()
    loop = SpeculativeLoop(NoisyDrafter(verifier, 10**9), verifier, draft_n=4, n_ctx=10_000)
    events, result = run(loop, [1], 20)
    assert [len(e.tokens) for e in events] == [5, 5, 5, 5]
    assert result.stats.acceptance_rate == 1.0
    assert result.stats.tokens_per_round == 5.0


def test_last_round_drafts_only_what_is_still_wanted():
    verifier = FakeVerifier()
    loop = SpeculativeLoop(NoisyDrafter(verifier, 10**9), verifier, draft_n=8, n_ctx=10_000)
    _, result = run(loop, [1], 12)
    assert verifier.rounds == [8, 2]  # 9 tokens, then 3: exactly 12
    assert len(result.tokens) == 12


def test_eos_stops_generation():
    verifier = FakeVerifier(eos_at=6)
    loop = SpeculativeLoop(NoisyDrafter(verifier, 3), verifier, draft_n=4, n_ctx=10_000)
    events, result = run(loop, [9, 9], 50)
    assert result.finish_reason == "eos"
    assert result.tokens[-1] == EOS
    assert len(result.tokens) == 7
    assert events[-1].eos


def test_context_limit_caps_drafts_and_stops_cleanly():
    verifier = FakeVerifier(n_ctx=20)
    loop = SpeculativeLoop(NoisyDrafter(verifier, 10**9), verifier, draft_n=4, n_ctx=20)
    _, result = run(loop, [1, 2, 3], 100)
    assert result.finish_reason == "context_full"
    assert len(verifier.committed) == 21  # the KV cache holds 20: every position used
    assert result.tokens == target_alone([1, 2, 3], 18, FakeVerifier())


def test_stats_count_bytes_of_this_generation_only():
    verifier = FakeVerifier()
    verifier.bytes_sent, verifier.bytes_received = 1000, 2000
    loop = SpeculativeLoop(NoisyDrafter(verifier, 2), verifier, draft_n=2, n_ctx=10_000)
    _, result = run(loop, [1], 6)
    assert result.stats.bytes_sent == 100 + 10 * result.stats.rounds
    assert result.stats.bytes_received == 20 * result.stats.rounds
    assert result.stats.total_time_s > 0


def test_session_is_closed_when_the_caller_stops_early():
    verifier = FakeVerifier()
    loop = SpeculativeLoop(NoisyDrafter(verifier, 2), verifier, draft_n=2, n_ctx=10_000)
    rounds = loop.run(PrefillRequest(prompt_tokens=[1]), 50)
    next(rounds)
    rounds.close()
    assert len(verifier.deleted) == 1 and re.fullmatch(SESSION_ID_PATTERN, verifier.deleted[0])


class ForgetfulVerifier(FakeVerifier):
    """Loses the session (as eviction or expiry would) before the given rounds."""

    def __init__(self, lose_before_rounds: set[int]):
        super().__init__()
        self.lose_before_rounds = lose_before_rounds
        self.reopened: list[list[int]] = []
        self.alive = True

    def prefill(self, request: PrefillRequest) -> PrefillResponse:
        if self.committed:  # a recovery: the whole committed list comes back
            self.reopened.append(list(request.prompt_tokens))
            assert request.add_bos is False
        else:
            return super().prefill(request)
        self.alive = True
        return self.opened(request.session_id)

    def verify(self, request: VerifyRequest) -> VerifyResponse:
        if len(self.rounds) in self.lose_before_rounds and self.alive:
            self.alive = False
            self.lose_before_rounds.discard(len(self.rounds))
            raise VerifierRejected(404, "session_not_found", "gone")
        return super().verify(request)


def test_lost_session_is_reopened_from_the_committed_tokens():
    verifier = ForgetfulVerifier({2, 5})
    loop = SpeculativeLoop(NoisyDrafter(verifier, 3), verifier, draft_n=3, n_ctx=10_000)
    _, result = run(loop, [4, 2], 30)
    assert result.tokens == target_alone([4, 2], 30, FakeVerifier())
    assert result.stats.recoveries == 2
    assert verifier.reopened[0] == [4, 2, *result.tokens][: len(verifier.reopened[0])]
    assert len(verifier.deleted) == 1  # the session, re-opened twice under its one id


def test_the_drafter_names_its_session_and_a_recovery_reopens_the_same_id():
    """A balancer routes by the id: the recovery must ask for the session it lost."""

    class Recording(ForgetfulVerifier):
        def __init__(self):
            super().__init__({2})
            self.asked: list[str | None] = []

        def prefill(self, request):
            self.asked.append(request.session_id)
            return super().prefill(request)

    verifier, other = Recording(), Recording()
    for v in (verifier, other):
        _, result = run(SpeculativeLoop(NoisyDrafter(v, 3), v, draft_n=3, n_ctx=10_000), [4, 2], 12)
        assert result.stats.recoveries == 1
    first, again = verifier.asked
    assert re.fullmatch(SESSION_ID_PATTERN, first) and again == first
    assert other.asked[0] != first  # each generation its own id


def test_a_prefill_whose_answer_was_lost_is_opened_again_under_its_id():
    """A retried prefill finds its id taken by its own first attempt: that session goes,
    and the prefill is made once more."""

    class Retried(FakeVerifier):
        def __init__(self):
            super().__init__()
            self.open_ids: set[str] = set()

        def prefill(self, request):
            if request.session_id in self.open_ids:
                raise VerifierRejected(409, "session_exists", "exists already")
            self.open_ids.add(request.session_id)
            if len(self.open_ids) == 1 and not self.deleted:  # the first answer is lost
                raise VerifierRejected(409, "session_exists", "exists already")
            return super().prefill(request)

        def delete_session(self, session_id):
            self.open_ids.discard(session_id)
            super().delete_session(session_id)

    verifier = Retried()
    loop = SpeculativeLoop(NoisyDrafter(verifier, 3), verifier, draft_n=3, n_ctx=10_000)
    _, result = run(loop, [4, 2], 10)
    assert result.tokens == target_alone([4, 2], 10, FakeVerifier())
    assert len(verifier.deleted) == 2  # the stray first session, then ours at the end


def test_context_overflow_from_the_verifier_ends_cleanly():
    class Overflowing(FakeVerifier):
        def verify(self, request):
            if len(self.rounds) == 2:
                raise VerifierRejected(400, "context_overflow", "needs 40, holds 32")
            return super().verify(request)

    verifier = Overflowing()
    loop = SpeculativeLoop(NoisyDrafter(verifier, 1000), verifier, draft_n=2, n_ctx=10_000)
    events, result = run(loop, [1], 30)
    assert result.finish_reason == "context_full"
    assert len(events) == 2 and result.tokens == target_alone([1], 6, FakeVerifier())


class BoundingVerifier(FakeVerifier):
    """A verifier bounding a session's generated tokens, as it does under a grammar whose
    end it cannot prove: a round that could pass the bound is refused."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.generated = limit, 0

    def prefill(self, request: PrefillRequest) -> PrefillResponse:
        self.generated = request.generated_tokens
        return super().prefill(request).model_copy(update={"grammar_token_limit": self.limit})

    def verify(self, request: VerifyRequest) -> VerifyResponse:
        if self.generated + len(request.draft_tokens) + (request.chunk_tokens or 1) > self.limit:
            raise VerifierRejected(400, "grammar_token_limit", "past the bound")
        answer = super().verify(request)
        self.generated += len(answer.tokens)
        return answer


@pytest.mark.parametrize("draft_n", [0, 3, 8])
def test_a_grammars_bound_ends_the_generation_there_and_says_so(draft_n):
    verifier = BoundingVerifier(limit=11)
    loop = SpeculativeLoop(NoisyDrafter(verifier, 3), verifier, draft_n=draft_n, n_ctx=10_000)
    _, result = run(loop, [4, 2], 40)
    assert result.finish_reason == "grammar_limit"
    assert result.tokens == target_alone([4, 2], 11, FakeVerifier())
    _, asked_less = run(loop, [4, 2], 9)  # the bound not reached: max_tokens as ever
    assert asked_less.finish_reason == "max_tokens" and len(asked_less.tokens) == 9


class SlowVerifier(FakeVerifier):
    """Answers after a pause, as a remote verifier does: pipelining has time to draft."""

    def verify(self, request: VerifyRequest) -> VerifyResponse:
        time.sleep(0.002)
        return super().verify(request)


class GatedVerifier(FakeVerifier):
    """Answers a round only once the drafter has finished drafting ahead for it: the
    state every pipelined round reaches on a slow link, reached here without timing."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def verify(self, request: VerifyRequest) -> VerifyResponse:
        assert self.gate.wait(timeout=60), "the drafter never finished drafting ahead"
        self.gate.clear()
        return super().verify(request)

    def gated(self, loop: SpeculativeLoop) -> SpeculativeLoop:
        prepare = loop.speculation.prepare

        def prepare_then_open_the_gate(*args, **kwargs) -> None:
            try:
                prepare(*args, **kwargs)
            finally:
                self.gate.set()

        loop.speculation.prepare = prepare_then_open_the_gate
        return loop


class ChainDrafter(NoisyDrafter):
    """Remembers what it drafted ahead and serves it back, like DraftModel's chain."""

    def __init__(self, verifier, wrong_every):
        super().__init__(verifier, wrong_every)
        self.chain: tuple[list[int], list[int]] = ([], [])
        self.ahead_calls = 0

    def get_candidates(self, committed, k, stop=None) -> Draft:
        base, chain = self.chain
        n = len(committed)
        if chain and list(committed[: len(base)]) == base and n > len(base):
            done = list(committed[len(base) :])
            if chain[: len(done)] == done and len(chain) > len(done):
                reused = chain[len(done) : len(done) + k]
                self.chain = ([], [])
                return Draft(reused, None, len(reused))
        if stop is not None:
            self.ahead_calls += 1
        draft = super().get_candidates(committed, k).tokens
        self.chain = (list(committed), draft)
        return Draft(draft, None)


@pytest.mark.parametrize("wrong_every", [2, 3, 7, 1000])
@pytest.mark.parametrize("draft_n", [1, 4])
def test_pipelined_output_equals_target_alone_and_reuses_good_guesses(wrong_every, draft_n):
    verifier = GatedVerifier()
    drafter = ChainDrafter(verifier, wrong_every)
    loop = verifier.gated(
        SpeculativeLoop(drafter, verifier, draft_n=draft_n, n_ctx=10_000, pipeline=True)
    )
    switch_interval = sys.getswitchinterval()
    events, result = run(loop, [5, 6, 7], 40)
    assert sys.getswitchinterval() == switch_interval  # no process-wide switch per run
    assert result.tokens == target_alone([5, 6, 7], 40, FakeVerifier())
    assert drafter.ahead_calls >= len(events) - 1  # drafted ahead during every round
    if wrong_every == 1000:
        # Every guess right: every round after the first was drafted while the previous
        # one was out.
        assert result.stats.reused_drafts == result.stats.drafted - draft_n
    assert result.stats.round_trip_s > 0 and result.stats.draft_time_s >= 0


def test_the_link_aware_length_learns_from_the_rounds_it_measures():
    verifier = SlowVerifier()  # a round costs the same whatever k: long drafts pay
    length = LinkAwareLength(maximum=8, start=2)
    loop = SpeculativeLoop(NoisyDrafter(verifier, 10**9), verifier, draft_n=length, n_ctx=10_000)
    _, result = run(loop, [1], 60)
    assert verifier.rounds[0] == 2 and max(verifier.rounds) == 8
    assert length.acceptance > 0.9
    assert result.tokens == target_alone([1], 60, FakeVerifier())


class WarmedDrafter(NoisyDrafter):
    """Records when `warm` ran relative to the prefill and the first draft."""

    warms = True

    def __init__(self, verifier: FakeVerifier, fail: bool = False):
        super().__init__(verifier, wrong_every=3)
        self.fail = fail
        self.events: list[str] = []

    def warm(self, prefill: PrefillRequest, stop=None) -> None:
        self.events.append(f"warm {list(prefill.prompt_tokens)}")
        if self.fail:
            raise RuntimeError("the prompt does not fit")

    def get_candidates(self, committed, k, stop=None) -> Draft:
        self.events.append("draft")
        return super().get_candidates(committed, k, stop)


@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.parametrize("fail", [False, True])
def test_pipelined_loop_warms_the_drafter_while_the_verifier_prefills(pipeline, fail):
    verifier = FakeVerifier()
    drafter = WarmedDrafter(verifier, fail=fail)
    loop = SpeculativeLoop(drafter, verifier, draft_n=3, n_ctx=10_000, pipeline=pipeline)
    _, result = run(loop, [5, 6, 7], 20)
    assert result.tokens == target_alone([5, 6, 7], 20, FakeVerifier())
    if pipeline:
        assert drafter.events[:2] == ["warm [5, 6, 7]", "draft"]  # once, before any draft
        assert drafter.events.count("warm [5, 6, 7]") == 1
    else:
        assert "warm [5, 6, 7]" not in drafter.events


class ChunkingVerifier(FakeVerifier):
    """Decodes chunks of its own tokens (`chunk_tokens`), 10 ms a token by its timings,
    and advises `advice(i)` with its i-th answer (the prefill's is the 0th)."""

    def __init__(self, advice=lambda i: 0, **kwargs):
        super().__init__(**kwargs)
        self.advice = advice
        self.answers = 0
        self.sent: list[tuple[int, int]] = []  # (draft tokens, chunk tokens) a round

    def _advised(self) -> int:
        self.answers += 1
        return self.advice(self.answers - 1)

    def opened(self, session_id: str) -> PrefillResponse:
        return super().opened(session_id).model_copy(update={"advised_draft": self._advised()})

    def verify(self, request: VerifyRequest) -> VerifyResponse:
        self.sent.append((len(request.draft_tokens), request.chunk_tokens or 1))
        if request.draft_tokens:
            return super().verify(request).model_copy(update={"advised_draft": self._advised()})
        steps = []
        for _ in range(request.chunk_tokens or 1):
            step = super().verify(VerifyRequest(session_id="s", n_past=len(self.committed)))
            steps.append(step)
            if step.eos:
                break
        tokens = [t for step in steps for t in step.tokens]
        ms = 10.0 * len(steps)
        timings = RoundTimings(decode_ms=ms, engine_ms=ms, decoded_tokens=len(steps))
        return steps[-1].model_copy(
            update={
                "tokens": tokens,
                "preds": tokens,
                "timings": timings,
                "advised_draft": self._advised(),
            }
        )


class LazyDrafter(NoisyDrafter):
    """Records every use of the draft model: warming (until the loop stops it), catching
    up, drafting. `caught_up`: what its catch-ups answer, in turn (then True)."""

    warms = catches_up = True

    def __init__(
        self,
        verifier: FakeVerifier,
        caught_up: Sequence[bool] = (),
        gate: threading.Event | None = None,
    ):
        super().__init__(verifier, wrong_every=1000)
        self.events: list[str] = []
        self.caught_up = list(caught_up)
        self.gate = gate  # a warming that ends once it opens (else once it is stopped)

    def warm(self, prefill: PrefillRequest, stop=None) -> None:
        if self.gate is not None:
            assert self.gate.wait(timeout=60), "the gate never opened"
            self.events.append("warm done")
            return
        deadline = time.monotonic() + 60
        while stop is not None and not stop() and time.monotonic() < deadline:
            time.sleep(0.001)
        self.events.append("warm stopped" if stop is not None and stop() else "warm")

    def catch_up(self, committed: Sequence[int], stop=None) -> bool:
        self.events.append(f"catch up {len(committed)}")
        return self.caught_up.pop(0) if self.caught_up else True

    def get_candidates(self, committed, k, stop=None) -> Draft:
        if stop is None:  # not drafting ahead
            self.events.append(f"draft {len(committed)}")
        return super().get_candidates(committed, k, stop)


@pytest.mark.parametrize("pipeline", [False, True])
def test_no_drafting_unwatched_sends_chunks_of_all_that_is_left_and_never_uses_the_model(
    pipeline,
):
    """`--draft-n 0` with nobody reading as it comes: a round per chunk the verifier takes,
    the last one cut to what is still wanted; the draft model never runs."""
    verifier = ChunkingVerifier()
    drafter = LazyDrafter(verifier)
    length = FixedLength(0, max_chunk=64, watched=False)
    loop = SpeculativeLoop(drafter, verifier, draft_n=length, n_ctx=10_000, pipeline=pipeline)
    _, result = run(loop, [5, 6, 7], 150)
    assert result.tokens == target_alone([5, 6, 7], 150, FakeVerifier())
    assert verifier.sent == [(0, 64), (0, 64), (0, 22)]
    assert drafter.events == []


def test_no_drafting_watched_sends_one_token_first_then_chunks_paced_by_the_verifier():
    verifier = ChunkingVerifier()
    length = FixedLength(0, max_chunk=64, watched=True)
    loop = SpeculativeLoop(NoisyDrafter(verifier, 1000), verifier, draft_n=length, n_ctx=10_000)
    _, result = run(loop, [5, 6, 7], 150)
    assert result.tokens == target_alone([5, 6, 7], 150, FakeVerifier())
    chunks = [m for _, m in verifier.sent]
    assert chunks[0] == 1 and len(chunks) < 10
    assert chunks[:-1] == sorted(chunks[:-1])


def test_chunks_end_at_eos_and_the_generation_with_them():
    verifier = ChunkingVerifier(eos_at=70)
    length = FixedLength(0, max_chunk=64, watched=False)
    loop = SpeculativeLoop(NoisyDrafter(verifier, 1000), verifier, draft_n=length, n_ctx=10_000)
    _, result = run(loop, [5, 6, 7], 150)
    assert result.tokens == target_alone([5, 6, 7], 150, FakeVerifier(eos_at=70))
    assert result.finish_reason == "eos" and len(verifier.sent) == 2


def test_advised_0_at_the_prefill_the_warming_stops_and_the_model_rests():
    """Auto where the verifier advises no draft from the start: the warming begun beside
    the prefill is stopped once its advice comes, and nothing else runs on the model."""
    verifier = ChunkingVerifier(advice=lambda i: 0)
    drafter = LazyDrafter(verifier)
    length = LinkAwareLength(maximum=8, max_chunk=64, watched=False)
    loop = SpeculativeLoop(drafter, verifier, draft_n=length, n_ctx=10_000, pipeline=True)
    _, result = run(loop, [5, 6, 7], 150)
    assert result.tokens == target_alone([5, 6, 7], 150, FakeVerifier())
    assert verifier.sent[0] == (0, 64)  # the prefill's advice: a large first chunk
    assert drafter.events == ["warm stopped"]


@pytest.mark.parametrize("caught_up", [[], [False]])
def test_before_auto_drafts_again_the_model_catches_up_during_a_chunk(caught_up):
    """The advice turns from 0 to 2: one more chunk, during which the draft model catches
    up with the committed tokens; only then a drafted round. A catch-up that the chunk's
    answer cut short holds the drafted round back for another chunk."""
    verifier = ChunkingVerifier(advice=lambda i: 0 if i < 2 else 2)
    drafter = LazyDrafter(verifier, caught_up)
    length = LinkAwareLength(maximum=8, max_chunk=8, watched=False)
    loop = SpeculativeLoop(drafter, verifier, draft_n=length, n_ctx=10_000, pipeline=True)
    _, result = run(loop, [5, 6, 7], 60)
    assert result.tokens == target_alone([5, 6, 7], 60, FakeVerifier())
    held = len(caught_up)
    assert [k for k, _ in verifier.sent[: 3 + held]] == [0] * (3 + held)
    assert verifier.sent[3 + held][0] > 0
    catch_ups = [f"catch up {3 + 8 * n}" for n in range(2, 3 + held)]
    assert drafter.events[: 2 + held] == ["warm stopped", *catch_ups]
    assert drafter.events[2 + held] == f"draft {3 + 8 * (3 + held)}"


def test_no_drafted_round_waits_for_the_warming_rounds_without_a_draft_go_meanwhile():
    """The verifier advises drafts from the prefill on, but the draft model is still
    warming up (a long prompt the verifier had cached): rounds without a draft, paced
    (one token first), until it is ready; the first draft only after it."""
    gate = threading.Event()

    class Opening(ChunkingVerifier):
        def verify(self, request: VerifyRequest) -> VerifyResponse:
            answer = super().verify(request)
            if len(self.sent) == 2:
                gate.set()  # the warming ends after the second round, before its answer
                while loop.warming.running():  # a state waited for, never a time
                    time.sleep(0.001)
            return answer

    verifier = Opening(advice=lambda i: 2)
    drafter = LazyDrafter(verifier, gate=gate)
    length = LinkAwareLength(maximum=8, max_chunk=64, watched=False)
    loop = SpeculativeLoop(drafter, verifier, draft_n=length, n_ctx=10_000, pipeline=True)
    _, result = run(loop, [5, 6, 7], 60)
    assert result.tokens == target_alone([5, 6, 7], 60, FakeVerifier())
    assert verifier.sent[:2] == [(0, 1), (0, round(CHUNK_S_FIRST / 0.01))]
    assert any(k for k, _ in verifier.sent)
    drafts = [i for i, event in enumerate(drafter.events) if event.startswith("draft")]
    assert drafts and drafter.events.index("warm done") < drafts[0]
