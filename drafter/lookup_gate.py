"""Whether a lookup's draft (prompt lookup, or the suffix drafter over the user's
history: free to make) goes out in a round that would go without a draft, where `auto`
has the draft model step aside and sends chunks of the verifier's own tokens.

A round of d drafted rows costs the verifier more than one step, so a copied span pays
only where enough of it is accepted. Measured, not priced: lookup rounds and chunks are
each measured whole (tokens over the round trip, drafting included), and lookups are
sent while they come at least as fast as chunks (so not before a chunk is measured).
Once they come slower, lookups rest for REST_FIRST rounds without a draft, twice as many
after each lookup round that loses again (up to REST_LAST), then one is tried again.
Pure: the loop passes what it measured."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from drafter.candidates import Draft, Drafter
from drafter.measured_rate import MeasuredRate, ProbeSchedule

# A shorter match wins at most one token over a chunk's step, for a wider round.
MIN_LOOKUP_TOKENS = 2
REST_FIRST = 4
REST_LAST = 64
# Lookup rounds measured before their rate is weighed against chunks'.
MIN_LOOKUP_ROUNDS = 2


@dataclass
class LookupGate:
    maximum: int  # the longest lookup draft (the verifier's max_draft)
    min_tokens: int = MIN_LOOKUP_TOKENS
    decay: float = 0.9
    resting: bool = False
    _lookups: MeasuredRate = field(default_factory=lambda: MeasuredRate(MIN_LOOKUP_ROUNDS))
    _chunks: MeasuredRate = field(default_factory=lambda: MeasuredRate(min_rounds=1))
    _rest: ProbeSchedule = field(default_factory=lambda: ProbeSchedule(REST_FIRST, REST_LAST))

    def draft(self, drafter: Drafter, committed: Sequence[int], room: int) -> Draft | None:
        """The lookup's draft for a round that would go without one (at most `room`
        tokens), where it may pay; None otherwise."""
        k = min(self.maximum, room)
        found = drafter.lookup_draft(committed, k) if k >= self.min_tokens else None
        return found if found is not None and self.wants(len(found.tokens)) else None

    def answered(self, looked_up: Draft | None, draft: Draft, tokens: int, seconds: float) -> None:
        """A round's answer, `tokens` committed in `seconds`: measured where the round was
        a lookup's draft (`looked_up`) or went without one (not the model's rounds)."""
        if looked_up is not None:
            self.lookup_round(tokens, seconds)
        elif not draft.tokens:
            self.chunk_round(tokens, seconds)

    def wants(self, found: int) -> bool:
        """Whether a lookup draft of `found` tokens goes out instead of a chunk."""
        if found < self.min_tokens or self._chunks.rate is None:
            return False  # a chunk first: what lookups are weighed against
        return not self.resting or self._rest.due

    def lookup_round(self, tokens: int, seconds: float) -> None:
        """A lookup round's answer: `tokens` committed in `seconds`."""
        if seconds <= 0:
            return
        # Neither kind fades the other: lookups come in bursts (a copied span), and a
        # burst would age the chunks' rate out of the comparison.
        self._lookups.add(tokens, seconds, self.decay)
        lookups, chunks = self._lookups.rate, self._chunks.rate
        slower = lookups is not None and chunks is not None and lookups < chunks
        if self.resting and slower:  # a try that lost again: a longer rest
            self._rest.probed()
        elif slower:
            self.resting = True
            self._rest.put_off()
        else:
            self.resting = False

    def chunk_round(self, tokens: int, seconds: float) -> None:
        """A round without a draft: `tokens` committed in `seconds`."""
        if seconds <= 0:
            return
        self._chunks.add(tokens, seconds, self.decay)
        if self.resting:
            self._rest.counted()
