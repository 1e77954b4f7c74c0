"""`auto` where the verifier advises a draft but this drafter's own time makes chunks
faster: the loop sends the short chunk that measures them, then chunks (alone) or goes
on drafting (where other sessions share the verifier's passes). A clock that moves only
as the fake verifier and drafter say, so every rate measured is fixed."""

from collections.abc import Sequence

import pytest

from drafter.length.chunk_pace import CHUNK_S_FIRST
from drafter.length.draft_length import LinkAwareLength
from drafter.speculative.candidates import Draft
from drafter.speculative.loop import SpeculativeLoop
from server.shared.protocol import RoundTimings, VerifyRequest, VerifyResponse
from tests.unit.test_loop import ChunkingVerifier, FakeVerifier, NoisyDrafter, run, target_alone

STEP_MS = 10.0  # a chunk's step
ROW_MS = 8.0  # each row of a drafted round past the first
DRAFT_TOKEN_MS = 8.0  # the draft model's time a token


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedVerifier(ChunkingVerifier):
    """Rounds that take their time on `clock`, and a verifier whose passes hold
    `pass_sessions` sessions."""

    def __init__(self, clock: Clock, pass_sessions: float, **kwargs):
        super().__init__(**kwargs)
        self.clock = clock
        self.pass_sessions = pass_sessions

    def verify(self, request: VerifyRequest) -> VerifyResponse:
        answer = super().verify(request)
        drafted = len(request.draft_tokens)
        ms = STEP_MS + ROW_MS * drafted if drafted else STEP_MS * len(answer.tokens)
        self.clock.now += ms / 1000.0
        timings = RoundTimings(decode_ms=ms, engine_ms=ms, decoded_tokens=drafted + 1)
        return answer.model_copy(update={"timings": timings, "pass_sessions": self.pass_sessions})


class TimedDrafter(NoisyDrafter):
    """Drafts the target's tokens (never wrong), DRAFT_TOKEN_MS a token on `clock`."""

    def __init__(self, verifier: FakeVerifier, clock: Clock):
        super().__init__(verifier, wrong_every=10**9)
        self.clock = clock

    def get_candidates(self, committed: Sequence[int], k: int, stop=None) -> Draft:
        self.clock.now += k * DRAFT_TOKEN_MS / 1000.0
        return super().get_candidates(committed, k, stop)


@pytest.mark.parametrize("pass_sessions", [1.0, 4.0])
def test_alone_a_short_chunk_measures_chunks_and_they_are_sent_from_then_on(pass_sessions):
    """Advised 1: a round of two rows (18 ms) and its draft (8 ms) bring two tokens, 77
    a second; a chunk's step brings one in 10 ms, 100 a second. Alone, chunks win once
    measured; where other sessions share the passes, no chunk goes to measure them."""
    clock = Clock()
    verifier = TimedVerifier(clock, pass_sessions, advice=lambda i: 1)
    length = LinkAwareLength(maximum=8, max_chunk=64, watched=False)
    loop = SpeculativeLoop(
        TimedDrafter(verifier, clock), verifier, draft_n=length, n_ctx=10_000, clock=clock
    )
    _, result = run(loop, [5, 6, 7], 200)
    assert result.tokens == target_alone([5, 6, 7], 200, FakeVerifier())
    sent = verifier.sent
    assert sent[:4] == [(1, 1)] * 4  # the advice's length, measured four times
    if pass_sessions == 1.0:
        assert sent[4][0] == 0 and sent[4][1] <= round(CHUNK_S_FIRST / (STEP_MS / 1000.0))
        chunked = sum(m for k, m in sent[5:] if k == 0)
        assert chunked > 0.8 * (200 - 8 - sent[4][1])  # nearly every token after it
    else:  # no chunk sent to measure chunks: a step would wait for the others' pass
        assert all(k for k, _ in sent[4:])
