"""The speculative loop, on one screen (after llama.cpp's speculative-simple).

Each round: draft k tokens locally, send them with n_past, commit what the verifier
returns (accepted drafts plus one target token). No printing here: the caller gets one
`RoundEvent` per round and renders it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from drafter.errors import VerifierRejected
from drafter.stats import GenerationStats
from server.protocol import PrefillRequest, PrefillResponse, VerifyRequest, VerifyResponse
from server.sampling import sparse

FinishReason = Literal["eos", "max_tokens", "context_full"]
# Consecutive lost sessions before giving up (a verifier evicting everything, say).
MAX_RECOVERIES_IN_A_ROW = 3


class Draft(Protocol):
    tokens: list[int]
    probs: Sequence[np.ndarray] | None  # q per position, sent when drafts were sampled


class CandidateGenerator(Protocol):
    def get_candidates(self, committed: Sequence[int], k: int) -> Draft: ...

    def update_candidate_strategy(
        self, draft_tokens: Sequence[int], accepted_prefix_len: int
    ) -> None: ...


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
    stats: GenerationStats = field(default_factory=GenerationStats)


class SpeculativeLoop:
    def __init__(
        self,
        drafter: CandidateGenerator,
        verifier: Verifier,
        *,
        draft_n: int,
        n_ctx: int,
    ):
        if draft_n < 0:
            raise ValueError("draft_n must be >= 0")
        self.drafter = drafter
        self.verifier = verifier
        self.draft_n = draft_n
        self.n_ctx = n_ctx
        self.result = SpeculativeResult()

    def run(self, prefill: PrefillRequest, max_tokens: int) -> Iterator[RoundEvent]:
        """Generate up to `max_tokens` tokens; yields each round as it is committed."""
        result = self.result = SpeculativeResult()
        stats = result.stats
        sent0, received0 = self.verifier.bytes_sent, self.verifier.bytes_received
        began = time.perf_counter()
        opened = self.verifier.prefill(prefill)
        result.prompt_ids = list(opened.prompt_ids)
        result.strategy, result.lossless = opened.strategy, opened.lossless
        stats.prompt_tokens = opened.prompt_len
        committed = list(opened.prompt_ids)
        session_id = opened.session_id
        lost_in_a_row = 0
        try:
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
                k = min(self.draft_n, remaining - 1, room)
                draft = self.drafter.get_candidates(committed, k)
                draft_tokens = list(draft.tokens)
                try:
                    verdict = self.verifier.verify(
                        VerifyRequest(
                            session_id=session_id,
                            n_past=len(committed),
                            draft_tokens=draft_tokens,
                            draft_probs=None
                            if draft.probs is None
                            else [sparse(q) for q in draft.probs],
                        )
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
                stats.generated_tokens = len(result.tokens)
                self.drafter.update_candidate_strategy(draft_tokens, verdict.accepted_prefix_len)
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
            stats.total_time_s = time.perf_counter() - began
            stats.bytes_sent = self.verifier.bytes_sent - sent0
            stats.bytes_received = self.verifier.bytes_received - received0
            self._close_session(session_id)

    def _reopen(self, prefill: PrefillRequest, committed: list[int]) -> str:
        reopened = self.verifier.prefill(
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
