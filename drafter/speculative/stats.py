"""What a generation cost and achieved, with the derived rates computed in one place."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of those, reused from the verifier's prefix cache
    generated_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    total_time_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    recoveries: int = 0  # new sessions opened after the verifier lost ours
    rejected_rounds: int = 0  # rounds where a draft token was refused
    # Rounds without a draft (k = 0: drafting could not pay) and the tokens they brought
    # (a chunk of the verifier's own each, or one).
    rounds_without_draft: int = 0
    tokens_without_draft: int = 0
    reused_drafts: int = 0  # draft tokens made while the previous round was in flight
    # Of the drafted rounds, those of a lookup's draft where a model drafts beside it
    # (model+ngram, model+suffix): sent where the model stepped aside
    # (drafter/length/lookup_gate.py) or found before the model drafted; rounds, tokens drafted
    # and accepted.
    lookup_rounds: int = 0
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    prefill_time_s: float = 0.0  # opening the session (the prompt's prefill)
    draft_time_s: float = 0.0  # drafting while nothing was in flight (the critical path)
    round_trip_s: float = 0.0  # /verify requests, sent to answered, as the drafter saw them
    verifier_time_s: float = 0.0  # the verifier's own time for those rounds (engine_ms)
    # How many rounds sent each draft length (k varies: auto, n-gram misses, the end).
    rounds_by_draft_len: dict[int, int] = field(default_factory=dict)
    # Drafting ahead (drafter/speculative/speculation.py): rounds during which it drafted, of those
    # the
    # ones whose answer it looked up (not the last round, nor one that ended in EOS),
    # answers it drafted for, answers it had drafted for, rounds sent with no drafting at
    # all, tokens drafted ahead, and of those the ones never sent.
    speculated_rounds: int = 0
    speculated_rounds_answered: int = 0
    speculated_answers: int = 0
    speculation_hits: int = 0
    rounds_sent_at_once: int = 0
    drafted_ahead: int = 0
    wasted_ahead: int = 0
    # Rounds whose answer was the drafter's r-th likeliest (drafter/speculative/speculation.py).
    answer_ranks: dict[int, int] = field(default_factory=dict)

    # The rates below, reported beside the counts.
    DERIVED: ClassVar[tuple[str, ...]] = (
        "acceptance_rate",
        "mean_draft_len",
        "tokens_per_round",
        "tokens_per_s",
        "bytes_sent_per_round",
        "bytes_received_per_round",
        "protocol_overhead_ms",
        "answers_per_round",
        "speculation_hit_rate",
    )

    def count_round(self, drafted: int, accepted: int, reused: int, tokens: int = 1) -> None:
        """A round of `drafted` tokens, `accepted` of them, `reused` drafted ahead; it
        committed `tokens` (accepted + 1, or a chunk's)."""
        if not drafted:
            self.rounds_without_draft += 1
            self.tokens_without_draft += tokens
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rejected_rounds += accepted < drafted
        self.reused_drafts += reused
        self.rounds_by_draft_len[drafted] = self.rounds_by_draft_len.get(drafted, 0) + 1

    def count_lookup(self, drafted: int, accepted: int) -> None:
        """Of the rounds counted, one of a lookup's draft where a model drafts beside it."""
        self.lookup_rounds += 1
        self.lookup_drafted += drafted
        self.lookup_accepted += accepted

    def add_speculation(self, counts) -> None:
        """The speculation cache's counts (drafter.speculative.speculation.SpeculationCounts)."""
        self.speculated_rounds += counts.rounds
        self.speculated_rounds_answered += counts.answered
        self.speculated_answers += counts.branches
        self.speculation_hits += counts.hits
        self.rounds_sent_at_once += counts.sent_at_once
        self.drafted_ahead += counts.drafted
        self.wasted_ahead += counts.drafted - counts.used
        for rank, rounds in counts.answer_ranks.items():
            self.answer_ranks[rank] = self.answer_ranks.get(rank, 0) + rounds

    def hit_rate_within(self, answers: int) -> float:
        """Rounds whose answer was among the drafter's `answers` likeliest, of the rounds
        drafted ahead for: the hit rate of a drafter that drafts for that many."""
        found = sum(n for rank, n in self.answer_ranks.items() if rank < answers)
        answered = self.speculated_rounds_answered
        return found / answered if answered else 0.0

    @property
    def answers_per_round(self) -> float:
        """Answers drafted for, per round during which the drafter drafted ahead."""
        return self.speculated_answers / self.speculated_rounds if self.speculated_rounds else 0.0

    @property
    def speculation_hit_rate(self) -> float:
        """Rounds whose answer had been drafted for, of the rounds drafted ahead for whose
        answer was looked up."""
        answered = self.speculated_rounds_answered
        return self.speculation_hits / answered if answered else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_draft_len(self) -> float:
        """Draft tokens per round, rounds without a draft counted as 0."""
        return self.drafted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.generated_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    @property
    def bytes_sent_per_round(self) -> float:
        return self.bytes_sent / self.rounds if self.rounds else 0.0

    @property
    def bytes_received_per_round(self) -> float:
        return self.bytes_received / self.rounds if self.rounds else 0.0

    @property
    def protocol_overhead_ms(self) -> float:
        """Per round: the round trip minus the verifier's own time (HTTP, JSON, threads,
        the network)."""
        if not self.rounds:
            return 0.0
        return (self.round_trip_s - self.verifier_time_s) * 1000.0 / self.rounds

    def as_dict(self) -> dict[str, float | int | dict[int, int]]:
        """Every count and rate, floats rounded to 4 places (`--output json`)."""
        names = [f.name for f in fields(self)] + list(self.DERIVED)
        return {
            name: round(value, 4) if isinstance(value, float) else value
            for name in names
            for value in [getattr(self, name)]
        }
