"""The speculative loop, on one screen (after llama.cpp's speculative-simple).

Each round: draft k tokens locally, send them with n_past, commit what the verifier
returns (accepted drafts plus one target token). No printing here: the caller gets one
`RoundEvent` per round and renders it.

Pipelined, the request goes out on a second thread and the drafter keeps drafting past it
as if every draft were accepted, its first extra token being its guess of the target's
token; when the answer agrees, that work is the next draft (the drafter keeps it, see
drafter/model.py), otherwise it is dropped. What is committed is still only what the
verifier returned: pipelining changes when drafts are made, never what is accepted.
"""

from __future__ import annotations

import contextlib
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol

import numpy as np

from drafter.draft_length import DraftLength, FixedLength
from drafter.errors import VerifierRejected
from drafter.stats import GenerationStats
from server.shared.protocol import PrefillRequest, PrefillResponse, VerifyRequest, VerifyResponse
from server.shared.sampling import sparse

FinishReason = Literal["eos", "max_tokens", "context_full"]
# Consecutive lost sessions before giving up (a verifier evicting everything, say).
MAX_RECOVERIES_IN_A_ROW = 3
# A thread waiting for the GIL otherwise waits a whole switch interval (5 ms) for it:
# pipelined, the verifier's answer wakes the sender thread while this one drafts.
SWITCH_INTERVAL_S = 0.0002


def prefer_quick_handoffs() -> None:
    """Set once when a process starts (the CLI, `serve`): hand the GIL over quickly, so a
    round's answer is picked up while the drafter works on the next one."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)


class Draft(NamedTuple):
    """What a drafter proposes for one round."""

    tokens: list[int]
    probs: Sequence[np.ndarray] | None  # q per position (dense), when drafts were sampled
    reused: int = 0  # leading tokens drafted while the previous round was in flight


class CandidateGenerator(Protocol):
    """Shaped like HF transformers' CandidateGenerator, without its learning hook: what a
    round's answer teaches (the next k) is the loop's DraftLength."""

    def get_candidates(
        self, committed: Sequence[int], k: int, stop: Callable[[], bool] | None = None
    ) -> Draft: ...

    # Optional: `warm(prefill)` evaluates the prompt ahead of the first draft; the
    # pipelined loop calls it while the verifier prefills (see SpeculativeLoop._open).


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


@dataclass
class SpeculativeResult:
    prompt_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # generated, the prompt excluded
    finish_reason: FinishReason | None = None
    strategy: str = "greedy"
    lossless: bool = True
    vocab: str = "same"  # the drafter's vocabulary against the verifier's (server/vocab.py)
    stats: GenerationStats = field(default_factory=GenerationStats)


class SpeculativeLoop:
    def __init__(
        self,
        drafter: CandidateGenerator,
        verifier: Verifier,
        *,
        draft_n: int | DraftLength,
        n_ctx: int,
        pipeline: bool = False,
        vocab: str = "same",
    ):
        if isinstance(draft_n, int):
            if draft_n < 0:
                raise ValueError("draft_n must be >= 0")
            draft_n = FixedLength(draft_n)
        self.drafter = drafter
        self.verifier = verifier
        self.draft_length = draft_n
        self.n_ctx = n_ctx
        self.pipeline = pipeline
        self.vocab = vocab
        self.result = SpeculativeResult()
        self._chosen_id: str | None = None

    @property
    def session_id(self) -> str | None:
        """The id the running (or last) generation's session goes by, on any replica."""
        return self._chosen_id

    def run(self, prefill: PrefillRequest, max_tokens: int) -> Iterator[RoundEvent]:
        """Generate up to `max_tokens` tokens; yields each round as it is committed."""
        result = self.result = SpeculativeResult(vocab=self.vocab)
        stats = result.stats
        # Ours to choose (random: ids are one space for every key), so that a balancer
        # can route the session by it, and a recovery re-opens it under the same id (on
        # whichever replica now has it).
        self._chosen_id = uuid.uuid4().hex
        prefill = prefill.model_copy(update={"session_id": self._chosen_id})
        sent0, received0 = self.verifier.bytes_sent, self.verifier.bytes_received
        sender = ThreadPoolExecutor(1, thread_name_prefix="verify") if self.pipeline else None
        began = time.perf_counter()
        try:
            opened = self._open(prefill, sender)
        except BaseException:
            if sender is not None:
                # Not waiting out a prefill on Ctrl-C: a session it still opens ends at
                # the verifier's idle TTL.
                sender.shutdown(wait=False, cancel_futures=True)
            raise
        session_id = opened.session_id
        try:
            stats.prefill_time_s = time.perf_counter() - began
            result.prompt_ids = list(opened.prompt_ids)
            result.strategy, result.lossless = opened.strategy, opened.lossless
            stats.prompt_tokens = opened.prompt_len
            stats.cached_prompt_tokens = opened.cached_tokens
            committed = list(opened.prompt_ids)
            lost_in_a_row = 0
            while True:
                remaining = max_tokens - len(result.tokens)
                if remaining <= 0:
                    result.finish_reason = "max_tokens"
                    break
                room = self.n_ctx - len(committed)  # a round needs committed + k <= n_ctx
                if room < 0:
                    result.finish_reason = "context_full"
                    break
                # A round commits at most k + 1 tokens: never more than asked for.
                k = min(self.draft_length.next(), remaining - 1, room)
                drafting = time.perf_counter()
                draft = self.drafter.get_candidates(committed, k)
                stats.draft_time_s += time.perf_counter() - drafting
                draft_tokens = list(draft.tokens)
                request = VerifyRequest(
                    session_id=session_id,
                    n_past=len(committed),
                    draft_tokens=draft_tokens,
                    draft_probs=None if draft.probs is None else [sparse(q) for q in draft.probs],
                )
                try:
                    if sender is None:
                        verdict, round_trip_s = self._timed_verify(request)
                    else:
                        verdict, round_trip_s = self._verify_drafting_ahead(
                            sender, request, committed, k
                        )
                except VerifierRejected as exc:
                    if exc.error_type == "context_overflow":
                        result.finish_reason = "context_full"
                        break
                    if exc.error_type != "session_not_found":
                        raise
                    # Evicted or expired: a new session from every committed token
                    # continues exactly where this one stopped.
                    lost_in_a_row += 1
                    if lost_in_a_row > MAX_RECOVERIES_IN_A_ROW:
                        raise
                    session_id = self._reopen(prefill, committed)
                    stats.recoveries += 1
                    continue
                lost_in_a_row = 0
                committed.extend(verdict.tokens)
                result.tokens.extend(verdict.tokens)
                stats.rounds += 1
                stats.drafted += len(draft_tokens)
                stats.accepted += verdict.accepted_prefix_len
                stats.rejected_rounds += verdict.accepted_prefix_len < len(draft_tokens)
                stats.reused_drafts += draft.reused
                by_len = stats.rounds_by_draft_len
                by_len[len(draft_tokens)] = by_len.get(len(draft_tokens), 0) + 1
                stats.round_trip_s += round_trip_s
                stats.verifier_time_s += verdict.timings.engine_ms / 1000.0
                stats.generated_tokens = len(result.tokens)
                self.draft_length.update(len(draft_tokens), verdict.accepted_prefix_len)
                yield RoundEvent(
                    draft_tokens=draft_tokens,
                    accepted_prefix_len=verdict.accepted_prefix_len,
                    tokens=list(verdict.tokens),
                    eos=verdict.eos,
                )
                if verdict.eos:
                    result.finish_reason = "eos"
                    break
        finally:
            if sender is not None:
                sender.shutdown(wait=True)
            stats.total_time_s = time.perf_counter() - began
            stats.bytes_sent = self.verifier.bytes_sent - sent0
            stats.bytes_received = self.verifier.bytes_received - received0
            self._close_session(session_id)

    def _open(self, prefill: PrefillRequest, sender: ThreadPoolExecutor | None) -> PrefillResponse:
        """The verifier's prefill. Pipelined, the drafter evaluates the prompt meanwhile,
        so its first draft does not wait for that on top of the verifier's."""
        warm = getattr(self.drafter, "warm", None)
        if sender is None or warm is None:
            return self._prefill(prefill)
        in_flight: Future = sender.submit(self._prefill, prefill)
        # A drafter that cannot take the prompt fails again at its first draft, with the
        # session open and closed by the loop; until then the prefill is what matters.
        with contextlib.suppress(Exception):
            warm(prefill)
        return in_flight.result()

    def _timed_verify(self, request: VerifyRequest) -> tuple[VerifyResponse, float]:
        began = time.perf_counter()
        verdict = self.verifier.verify(request)
        return verdict, time.perf_counter() - began

    def _verify_drafting_ahead(
        self, sender: ThreadPoolExecutor, request: VerifyRequest, committed: list[int], k: int
    ) -> tuple[VerifyResponse, float]:
        """Send the round, and draft the next one while it is out: the guess of the
        target's token and up to k after it, stopping as soon as the answer is in."""
        in_flight: Future = sender.submit(self._timed_verify, request)
        ahead = [*committed, *request.draft_tokens]
        if len(ahead) + k + 1 < self.n_ctx:
            self.drafter.get_candidates(ahead, k + 1, stop=in_flight.done)
        return in_flight.result()

    def _prefill(self, request: PrefillRequest) -> PrefillResponse:
        try:
            opened = self.verifier.prefill(request)
        except VerifierRejected as exc:
            if exc.error_type != "session_exists" or request.session_id != self._chosen_id:
                raise
            # The id is our own random one: a prefill retried after its answer was lost
            # has opened it already. That session is dropped and opened again, once.
            self._close_session(request.session_id)
            opened = self.verifier.prefill(request)
        if opened.session_id != request.session_id:
            raise VerifierRejected(
                502,
                "protocol_error",
                f"asked for session {request.session_id!r}, "
                f"the verifier opened {opened.session_id!r}",
            )
        return opened

    def _reopen(self, prefill: PrefillRequest, committed: list[int]) -> str:
        reopened = self._prefill(
            prefill.model_copy(
                update={"prompt": None, "prompt_tokens": list(committed), "add_bos": False}
            )
        )
        return reopened.session_id

    def _close_session(self, session_id: str) -> None:
        # Best effort: the session holds a KV sequence on the server until it is freed,
        # and a failed cleanup must not hide the result.
        with contextlib.suppress(Exception):
            self.verifier.delete_session(session_id)
