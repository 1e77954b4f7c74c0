"""The speculative loop, on one screen (after llama.cpp's speculative-simple).

Each round: draft k tokens locally, send them with n_past, commit what the verifier
returns (accepted drafts plus one target token). No printing here: the caller gets one
`RoundEvent` per round and renders it.

Pipelined, the request goes out on a second thread and, while it is out, the drafter
drafts the next round for the verifier's likeliest answers (drafter/speculative/speculation.py);
when
the answer is one of them, the next round goes out at once. What is committed is still
only what the verifier returned: pipelining changes when drafts are made, never what is
accepted.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, Protocol

from drafter.errors import VerifierRejected
from drafter.length.lookup_gate import LookupGate
from drafter.length.plain_lengths import FixedLength
from drafter.speculative.candidates import Draft, Drafter, DraftLength, RoundTiming
from drafter.speculative.draft_readiness import catches_up, drafts_soon, holds_back
from drafter.speculative.remote_session import RemoteSessions, within_limit
from drafter.speculative.round_parts import count_round, round_timing, verify_request
from drafter.speculative.speculation import SpeculationCache
from drafter.speculative.stats import GenerationStats
from drafter.speculative.warming import Warming
from server.shared.protocol import (
    PrefillRequest,
    PrefillResponse,
    TokenLogprob,
    VerifyRequest,
    VerifyResponse,
)

FinishReason = Literal["eos", "max_tokens", "grammar_limit", "context_full", "interrupted"]
# Consecutive lost sessions before giving up (a verifier evicting everything, say).
MAX_RECOVERIES_IN_A_ROW = 3
# A thread waiting for the GIL otherwise waits a whole switch interval (5 ms) for it:
# pipelined, the verifier's answer wakes the sender thread while this one drafts.
SWITCH_INTERVAL_S = 0.0002


def prefer_quick_handoffs() -> None:
    """Set once when a process starts (the CLI, `serve`): hand the GIL over quickly, so a
    round's answer is picked up while the drafter works on the next one."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)


class Verifier(Protocol):
    bytes_sent: int
    bytes_received: int

    def prefill(self, request: PrefillRequest) -> PrefillResponse: ...

    def verify(self, request: VerifyRequest) -> VerifyResponse: ...

    def delete_session(self, session_id: str) -> None: ...


@dataclass(frozen=True)
class RoundEvent:
    draft_tokens: list[int]
    accepted_prefix_len: int
    tokens: list[int]  # committed this round: accepted drafts, then the target's token
    eos: bool
    logprobs: list[TokenLogprob] | None = None  # one a token, where the prefill asked


@dataclass
class SpeculativeResult:
    prompt_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # generated, the prompt excluded
    finish_reason: FinishReason | None = None
    strategy: str = "greedy"
    lossless: bool = True
    vocab: str = "same"  # the drafter's vocabulary against the verifier's (server/shared/vocab.py)
    stats: GenerationStats = field(default_factory=GenerationStats)


class SpeculativeLoop:
    def __init__(
        self,
        drafter: Drafter,
        verifier: Verifier,
        *,
        draft_n: int | DraftLength,
        n_ctx: int,
        pipeline: bool = False,
        branches: int = 4,
        vocab: str = "same",
        clock: Callable[[], float] = time.perf_counter,
        lookups: LookupGate | None = None,
        mark_lookups: bool = False,
    ):
        """`pipeline`: draft while rounds are out, for up to `branches` likely answers
        (1: only every token accepted and the drafter's own guess after them). `clock`
        times everything the loop learns from (tests give one that stands still).
        `lookups`: a lookup's free drafts where the length sends no draft, if they pay.
        `mark_lookups`: a lookup's draft says so (the verifier's /info `lookup_drafts`)."""
        self.drafter = drafter
        self.verifier = verifier
        self.draft_length = draft_length_of(draft_n)
        self.n_ctx = n_ctx
        self.pipeline, self.clock = pipeline, clock
        self.speculation = SpeculationCache(drafter, branches, clock=clock) if pipeline else None
        self.vocab = vocab
        self.lookups, self.mark_lookups = lookups, mark_lookups
        self.result = SpeculativeResult()
        self.sessions = RemoteSessions(verifier)
        # Learned as rounds go: a round trip, a drafted token (what speculation has).
        self._wait_s, self._token_s = float("inf"), 0.0
        self.warming = Warming()
        self._behind = False  # the draft model lacks committed tokens: rounds without drafts
        self._grammar_bound = False  # the verifier's bound on a grammar's tokens holds

    @property
    def session_id(self) -> str | None:
        """The id the running (or last) generation's session goes by, on any replica."""
        return self.sessions.chosen_id

    def run(self, prefill: PrefillRequest, max_tokens: int) -> Generator[RoundEvent, None, None]:
        """Generate up to `max_tokens` tokens; yields each round as it is committed."""
        self.result = SpeculativeResult(vocab=self.vocab)
        self._behind = False
        # Ours to choose (random: ids are one space for every key), so that a balancer
        # can route the session by it, and a recovery re-opens it under the same id (on
        # whichever replica now has it).
        self.sessions.chosen_id = uuid.uuid4().hex
        prefill = prefill.model_copy(update={"session_id": self.sessions.chosen_id})
        sent0, received0 = self.verifier.bytes_sent, self.verifier.bytes_received
        sender = ThreadPoolExecutor(1, thread_name_prefix="verify") if self.pipeline else None
        began = self.clock()
        try:
            opened = self._open(prefill, sender)
        except BaseException:
            self.warming.wait()  # no thread left on the draft model
            if sender is not None:
                # Not waiting out a prefill on Ctrl-C: a session it still opens ends at
                # the verifier's idle TTL.
                sender.shutdown(wait=False, cancel_futures=True)
            raise
        session = [opened.session_id]  # a recovery replaces it
        try:
            self._opened(opened, self.clock() - began)
            if not drafts_soon(self.draft_length):
                # The prefill's advice: rounds without a draft for a while. The draft
                # model has no use for the prompt until then (drafts_soon catches up).
                self.warming.stop()
            prompt_len = len(opened.prompt_ids) - prefill.generated_tokens
            follow_rules(self.drafter, prefill, prompt_len)
            max_tokens, self._grammar_bound = within_limit(max_tokens, opened, prefill)
            yield from self._rounds(prefill, session, sender, max_tokens)
        finally:
            self.warming.wait()  # no thread left using the draft model after the run
            if sender is not None:
                sender.shutdown(wait=True)
            stats = self.result.stats
            stats.total_time_s = self.clock() - began
            stats.bytes_sent = self.verifier.bytes_sent - sent0
            stats.bytes_received = self.verifier.bytes_received - received0
            if self.speculation is not None:
                stats.add_speculation(self.speculation.counts)
            self.sessions.close(session[0])
            self.drafter.finish([*self.result.prompt_ids, *self.result.tokens])

    def _opened(self, opened: PrefillResponse, prefill_s: float) -> None:
        result, stats = self.result, self.result.stats
        result.prompt_ids = list(opened.prompt_ids)
        result.strategy, result.lossless = opened.strategy, opened.lossless
        stats.prefill_time_s = prefill_s
        stats.prompt_tokens = opened.prompt_len
        stats.cached_prompt_tokens = opened.cached_tokens
        self.draft_length.advise(opened.advised_draft)  # the first round too

    def _rounds(
        self, prefill: PrefillRequest, session: list[str], sender: ThreadPoolExecutor | None,
        max_tokens: int,
    ) -> Iterator[RoundEvent]:  # fmt: skip
        result = self.result
        committed = list(result.prompt_ids)
        ready: Draft | None = None  # the next round's draft, made while this one was out
        lost_in_a_row = 0
        while (k := self._next_k(committed, max_tokens, ahead=ready is not None)) is not None:
            held = ready is None and holds_back(self.draft_length, k, self._behind, self.warming)
            if held:  # no wait for the draft model: it catches up while this round is out
                k, self._behind = 0, True
            drafting = self.clock()
            if ready is not None:  # made for this answer; k may have changed since
                draft = ready.first(k)
            elif k > 0:
                self.warming.wait()
                draft = self.drafter.get_candidates(committed, k)
            else:
                draft = Draft([], None)
            looked_up = _looked_up(self, committed, max_tokens) if k == 0 else None
            draft = looked_up or draft
            draft_s = self.clock() - drafting
            result.stats.draft_time_s += draft_s
            if draft.tokens and not draft.reused and not draft.lookup:  # the model's time
                self._token_s = _ema(self._token_s, draft_s / len(draft.tokens))
            # No draft: a chunk of the verifier's own tokens, where it decodes them.
            # A lookup the verifier sizes is the chunk it would have been where none of it pays.
            sized = bool(draft.tokens) and draft.accept is not None
            chunk = _chunk(self, committed, max_tokens, held) if sized or not draft.tokens else 1
            try:
                verdict, round_trip_s, ready = self._verify(
                    sender, session[0], committed, draft, max_tokens, chunk
                )
            except VerifierRejected as exc:
                ready = None
                if exc.error_type == "context_overflow":
                    result.finish_reason = "context_full"
                    return
                if exc.error_type != "session_not_found":
                    raise
                if lost_in_a_row >= MAX_RECOVERIES_IN_A_ROW:
                    raise
                # Evicted or expired: a new session from every committed token continues
                # exactly where this one stopped.
                lost_in_a_row += 1
                prompt_len = len(self.result.prompt_ids) - prefill.generated_tokens
                session[0] = self.sessions.reopen(prefill, committed, prompt_len)
                result.stats.recoveries += 1
                continue
            lost_in_a_row = 0
            self._wait_s = _ema(self._wait_s, round_trip_s)
            draft, looked_up = _as_verified(self.drafter, draft, looked_up, verdict)
            timing = round_timing(draft, verdict, draft_s, round_trip_s)
            if self.lookups is not None:
                self.lookups.answered(looked_up, draft, len(verdict.tokens), timing.seconds)
            # A lookup's round, gated or found before the model's: not what its length learns.
            lookup = looked_up is not None or (draft.lookup and self.drafter.mixes_kinds)
            yield self._commit(committed, draft, verdict, timing, lookup=lookup)
            if verdict.eos:
                result.finish_reason = "eos"
                return

    def _next_k(self, committed: list[int], max_tokens: int, ahead: bool) -> int | None:
        """The next round's draft length (`ahead`: its draft is made already), or None when
        the generation is over."""
        result = self.result
        remaining = max_tokens - len(result.tokens)
        if remaining <= 0:
            result.finish_reason = "grammar_limit" if self._grammar_bound else "max_tokens"
            return None
        room = self.n_ctx - len(committed)  # a round needs committed + k <= n_ctx
        if room < 0:
            result.finish_reason = "context_full"
            return None
        # A round commits at most k + 1 tokens: never more than asked for.
        return min(self.draft_length.next(ahead=ahead), remaining - 1, room)

    def _commit(
        self,
        committed: list[int],
        draft: Draft,
        verdict: VerifyResponse,
        timing: RoundTiming,
        lookup: bool = False,
    ) -> RoundEvent:
        committed.extend(verdict.tokens)
        self.result.tokens.extend(verdict.tokens)
        count_round(self.result.stats, draft, verdict, timing, len(self.result.tokens), lookup)
        if not lookup:  # a lookup's round: the length learns of the model's and chunks
            self.draft_length.update(len(draft.tokens), verdict.accepted_prefix_len)
        self.draft_length.advise(verdict.advised_draft, verdict.pass_sessions)
        if not lookup:
            self.draft_length.observe(timing)
        return RoundEvent(
            draft_tokens=list(draft.tokens),
            accepted_prefix_len=verdict.accepted_prefix_len,
            tokens=list(verdict.tokens),
            eos=verdict.eos,
            logprobs=verdict.logprobs,
        )

    def _verify(
        self,
        sender: ThreadPoolExecutor | None,
        session_id: str,
        committed: list[int],
        draft: Draft,
        max_tokens: int,
        chunk: int = 1,
    ) -> tuple[VerifyResponse, float, Draft | None]:
        """The round's answer, its round trip, and the next round's draft if it was made
        while this one was out (pipelined) for the answer that came."""
        request = verify_request(session_id, committed, draft, chunk, self.mark_lookups)
        if sender is None:
            return (*self._timed_verify(request), None)
        in_flight: Future = sender.submit(self._timed_verify, request)
        k = self.draft_length.next(ahead=True)
        room = self.n_ctx - len(committed) - len(draft.tokens) - 1
        wanted = max_tokens - len(self.result.tokens)
        catching_up = catches_up(self.draft_length, self._behind, draft, wanted, chunk)
        # A chunk's answer is many tokens, and a chunk follows a probe's last drafted
        # round: nothing to draft ahead for.
        chunk_next = bool(draft.tokens) and self.draft_length.chunk_soon()
        speculation = self.speculation if chunk == 1 and not (catching_up or chunk_next) else None
        if catching_up:
            self._behind = not self.warming.catch_up(self.drafter, committed, in_flight.done)
        if speculation is not None and 0 < k < room:
            self.warming.wait()
            speculation.prepare(
                committed, draft.tokens, k, in_flight.done, self._wait_s, self._token_s
            )
        elif self.speculation is not None:
            self.speculation.forget()
        verdict, round_trip_s = in_flight.result()
        ready = None
        left = max_tokens - len(self.result.tokens) - len(verdict.tokens)
        if speculation is not None and not verdict.eos and left > 1:
            token = verdict.tokens[-1]
            ready = speculation.take(verdict.accepted_prefix_len, token, min(k, left - 1))
        return verdict, round_trip_s, ready

    def _open(self, prefill: PrefillRequest, sender: ThreadPoolExecutor | None) -> PrefillResponse:
        """The verifier's prefill; pipelined, the drafter warms up meanwhile (warming.py)
        unless it is not to draft."""
        if sender is None or not self.drafter.warms or not drafts_soon(self.draft_length):
            return self.sessions.open(prefill)
        in_flight: Future = sender.submit(self.sessions.open, prefill)
        self.warming.start(self.drafter.warm, prefill)
        return in_flight.result()

    def _timed_verify(self, request: VerifyRequest) -> tuple[VerifyResponse, float]:
        began = self.clock()
        verdict = self.verifier.verify(request)
        return verdict, self.clock() - began


def _chunk(
    loop: SpeculativeLoop, committed: list[int], max_tokens: int, paced: bool = False
) -> int:
    """The tokens a round without a draft asks for: what the draft length says (`paced`:
    a round held back for the draft model, sized so that the drafted round follows
    soon), never past the tokens asked for or the context."""
    remaining = max_tokens - len(loop.result.tokens)
    room = loop.n_ctx - len(committed) + 1
    chunk = loop.draft_length.chunk(paced=True) if paced else loop.draft_length.chunk()
    return max(1, min(chunk, remaining, room))


def draft_length_of(draft_n: int | DraftLength) -> DraftLength:
    """A fixed k as a draft length; a draft length as it is."""
    if not isinstance(draft_n, int):
        return draft_n
    if draft_n < 0:
        raise ValueError("draft_n must be >= 0")
    return FixedLength(draft_n)


def _looked_up(loop: SpeculativeLoop, committed: list[int], max_tokens: int) -> Draft | None:
    """A lookup's draft for a round that would go without one, where it may pay (held
    back for the draft model too: a lookup needs none)."""
    if loop.lookups is None:
        return None
    room = min(loop.n_ctx - len(committed), max_tokens - len(loop.result.tokens) - 1)
    return loop.lookups.draft(loop.drafter, committed, room)


def _as_verified(
    drafter: Drafter, draft: Draft, looked_up: Draft | None, verdict: VerifyResponse
) -> tuple[Draft, Draft | None]:
    """The round's draft as the verifier judged it, which the drafter learns from: a
    lookup it sized, as much as it verified (none: a round without a draft)."""
    verified = len(draft.tokens) if verdict.draft_verified is None else verdict.draft_verified
    if draft.tokens:
        drafter.answered(draft, verified, verdict.accepted_prefix_len)
    if not verified:  # the chunk it asked for: a round without a draft, of no kind
        return Draft([], None), None
    if verified < len(draft.tokens):
        draft = draft.first(verified)
        looked_up = looked_up and draft
    return draft, looked_up


def _ema(mean: float, value: float, weight: float = 0.2) -> float:
    """A running mean that follows recent values (the first value starts it)."""
    if mean in (0.0, float("inf")):
        return value
    return (1 - weight) * mean + weight * value


def follow_rules(drafter: Drafter, prefill: PrefillRequest, prompt_len: int) -> None:
    """Drafts follow the verifier's penalties, biases and grammar where the drafter can
    (DraftModel.follow): more of them are accepted."""
    drafter.follow(prefill.sampling, prefill.grammar, prompt_len)
