"""Whether a lookup's draft (prompt lookup, or the suffix drafter over the user's
history: free to make) goes out in a round that would go without a draft, where `auto`
has the draft model step aside and sends chunks of the verifier's own tokens.

A round of d drafted rows costs the verifier more than one step, so a copied span pays
only where enough of it is accepted. Measured, not priced: lookup rounds and chunks are
each measured whole (tokens over the round trip, drafting included), and lookups are
sent while they come at least as fast as chunks (so not before a chunk is measured).
Once they come slower, lookups rest for REST_FIRST rounds without a draft, twice as many
after each lookup round that loses again (up to REST_LAST), then one is tried again.
A draft the verifier sizes (one with its estimated acceptance, where the verifier's /info
says `lookup_sizing`; a lookup is then made while resting too) goes whenever one is
found: the verifier verifies as much of it as pays, and where none does, the round is
the chunk it would have been (no round trip more than the chunk).
Pure: the loop passes what it measured."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from drafter.length.measured_rate import MeasuredRate, ProbeSchedule
from drafter.speculative.candidates import Draft, Drafter

# A shorter match wins at most one token over a chunk's step, for a wider round.
MIN_LOOKUP_TOKENS = 2
REST_FIRST = 4
REST_LAST = 64
# Lookup rounds measured before their rate is weighed against chunks'.
MIN_LOOKUP_ROUNDS = 2


@dataclass
class LookupGate:
    maximum: int  # the longest lookup draft (the verifier's max_draft)
    sized: bool = False  # the verifier sizes drafts that carry their acceptance
    min_tokens: int = MIN_LOOKUP_TOKENS
    decay: float = 0.9
    resting: bool = False
    _lookups: MeasuredRate = field(default_factory=lambda: MeasuredRate(MIN_LOOKUP_ROUNDS))
    _chunks: MeasuredRate = field(default_factory=lambda: MeasuredRate(min_rounds=1))
    _rest: ProbeSchedule = field(default_factory=lambda: ProbeSchedule(REST_FIRST, REST_LAST))

    def draft(self, drafter: Drafter, committed: Sequence[int], room: int) -> Draft | None:
        """The lookup's draft for a round that would go without one (at most `room`
        tokens), where it may pay; None otherwise (and no lookup made while resting)."""
        k = min(self.maximum, room)
        if k < self.min_tokens or not (self.sized or self.open):
            return None
        found = drafter.lookup_draft(committed, k)
        if self.sized and found.accept is not None:
            return found if len(found.tokens) >= self.min_tokens else None
        return found if self.wants(len(found.tokens)) else None

    def answered(self, looked_up: Draft | None, draft: Draft, tokens: int, seconds: float) -> None:
        """A round's answer, `tokens` committed in `seconds`: measured where the round was
        a lookup's draft (`looked_up`) or went without one (not the model's rounds)."""
        if looked_up is not None:
            self.lookup_round(tokens, seconds)
        elif not draft.tokens:
            self.chunk_round(tokens, seconds)

    @property
    def open(self) -> bool:
        """Whether a lookup may go now: chunks measured (what lookups are weighed
        against), and not resting (or a try is due)."""
        return self._chunks.rate is not None and (not self.resting or self._rest.due)

    def wants(self, found: int) -> bool:
        """Whether a lookup draft of `found` tokens goes out instead of a chunk."""
        return found >= self.min_tokens and self.open

    def lookup_round(self, tokens: int, seconds: float) -> None:
        """A lookup round's answer: `tokens` committed in `seconds`."""
        if seconds <= 0:
            return
        chunks = self._chunks.rate
        if self.resting:  # a try after a rest, judged on its own
            if chunks is not None and tokens / seconds < chunks:
                self._rest.probed()  # lost again: a longer rest
                return
            # Won: lookups measured afresh, and the next rest from the shortest.
            self.resting = False
            self._lookups = MeasuredRate(MIN_LOOKUP_ROUNDS)
            self._rest = ProbeSchedule(REST_FIRST, REST_LAST)
        # Neither kind fades the other: lookups come in bursts (a copied span), and a
        # burst would age the chunks' rate out of the comparison.
        self._lookups.add(tokens, seconds, self.decay)
        lookups = self._lookups.rate
        if lookups is not None and chunks is not None and lookups < chunks:
            self.resting = True
            self._rest.put_off()

    def chunk_round(self, tokens: int, seconds: float) -> None:
        """A round without a draft: `tokens` committed in `seconds`."""
        if seconds <= 0:
            return
        self._chunks.add(tokens, seconds, self.decay)
        if self.resting:
            self._rest.counted()
