"""The loop's contracts, every hook declared with its default: what a drafter proposes for
a round (`Draft`), what a drafter is (`Drafter`: the model, prompt lookup, lookup with the
model behind it, or the model through text), what a draft-length policy is
(`DraftLength`: drafter/length/draft_length.py), and what a round cost it (`RoundTiming`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from server.shared.protocol import Grammar, PrefillRequest, SamplingParams


@dataclass
class RoundTiming:
    """What one round cost, as the loop measured it."""

    rows: int  # the verifier's rows for it (k + 1)
    verifier_s: float  # the verifier's own time for it (engine_ms)
    round_trip_s: float  # sent to answered, as the drafter saw it
    draft_s: float  # drafting done before it could be sent (the critical path)
    drafted_ahead: bool  # its draft was ready when the previous answer came
    steps: int = 1  # a round without a draft: the tokens (one pass each) it asked for
    tokens: int = 1  # the tokens it committed

    @property
    def seconds(self) -> float:
        """The round as its user waits for it: drafting on its path, then the round trip."""
        return self.draft_s + self.round_trip_s


class Draft(NamedTuple):
    """What a drafter proposes for one round."""

    tokens: list[int]
    probs: Sequence[np.ndarray] | None  # q per position (dense), when drafts were sampled
    reused: int = 0  # leading tokens drafted while the previous round was in flight
    lookup: bool = False  # a lookup's (a copy of earlier text), not a draft model's
    # A lookup's estimate of how often a token of it is accepted, where it has one (the
    # verifier may then size it: draft_accept), and the length of the match it came from.
    accept: float | None = None
    match: int = 0

    def first(self, k: int) -> Draft:
        """Its first `k` tokens: a draft made ahead, for a round whose k changed since (or
        a lookup's, as much of it as the verifier verified)."""
        probs = None if self.probs is None else self.probs[:k]
        return self._replace(tokens=self.tokens[:k], probs=probs, reused=min(k, self.reused))


class Drafter:
    """What the loop asks of a drafter, each hook with its default: a drafter overrides
    what it does. Shaped like HF transformers' CandidateGenerator (`get_candidates`),
    without its learning hook: what a round's answer teaches (the next k) is the loop's
    DraftLength."""

    # Whether `warm` does work (the loop then warms the drafter while the verifier
    # prefills), and whether `catch_up` does (a cache of evaluated tokens that rounds
    # without a draft leave behind).
    warms: bool = False
    catches_up: bool = False
    # Whether its drafts come from a lookup as well as a model: the draft length, which
    # prices the model's drafts, then learns from the model's rounds alone.
    mixes_kinds: bool = False

    def get_candidates(
        self, committed: Sequence[int], k: int, stop: Callable[[], bool] | None = None
    ) -> Draft:
        """Up to k tokens to follow `committed`, until `stop()`."""
        raise NotImplementedError

    def warm(self, prefill: PrefillRequest, stop: Callable[[], bool] | None = None) -> None:
        """Evaluate the prompt ahead of the first draft (while the verifier prefills)."""

    def catch_up(self, committed: Sequence[int], stop: Callable[[], bool] | None = None) -> bool:
        """Evaluate the committed tokens the drafter lacks, until `stop()`; whether it
        holds them all now."""
        return True

    def follow(self, sampling: SamplingParams, grammar: Grammar | None, prompt_len: int) -> None:
        """Draft under the verifier's penalties, biases and grammar (more is accepted)."""

    def likely_answers(
        self, committed: Sequence[int], draft: Sequence[int], limit: int
    ) -> list[tuple[int, int]] | None:
        """The verifier's likeliest answers to `draft`, as (accepted prefix, next token),
        best first (drafter/speculative/speculation.py); None where the drafter cannot rank them."""
        return None

    def lookup_draft(self, committed: Sequence[int], k: int) -> Draft:
        """A draft that costs nothing to make (a lookup's match, up to `k` tokens), for a
        round that would go without one (drafter/length/lookup_gate.py); none by default."""
        return Draft([], None)

    def answered(self, draft: Draft, verified: int, accepted_prefix_len: int) -> None:
        """A round's answer to its draft: `verified` of its tokens judged (fewer than
        drafted where the verifier sized a lookup), `accepted_prefix_len` of them
        accepted. A drafter that estimates its drafts' acceptance learns from it."""

    def finish(self, text: Sequence[int]) -> None:
        """The generation ended with `text` (its prompt and output): a drafter that
        learns from its user's history keeps it."""


class DraftLength:
    """What the loop asks of a draft-length policy, each with its default: a policy
    overrides what it uses."""

    @property
    def label(self) -> str:
        raise NotImplementedError

    @property
    def adaptive(self) -> bool:
        """A draft only when it pays, so none while the draft model is not ready: the
        loop sends a round without a draft rather than wait for it (else it waits)."""
        return False

    def next(self, ahead: bool = False) -> int:
        """The draft length of the next round (`ahead`: of a draft made while a round
        is out)."""
        raise NotImplementedError

    def drafts_soon(self) -> bool:
        """Whether the round after this round without a draft carries one."""
        return False

    def chunk_soon(self) -> bool:
        """Whether the round after this drafted round goes without a draft, whatever its
        answer: nothing to draft ahead for."""
        return False

    def chunk(self, paced: bool = False) -> int:
        """Tokens a round without a draft asks for."""
        return 1

    def update(self, drafted: int, accepted_prefix_len: int) -> None:
        """What a round's answer teaches."""

    def observe(self, timing: RoundTiming) -> None:
        """A round's times, as the loop measured them."""

    def advise(self, advised: int | None, pass_sessions: float | None = None) -> None:
        """The verifier's advised draft length (None: it gives none), and how many
        sessions its recent passes held (None: not told)."""
