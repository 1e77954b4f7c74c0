"""Draft lengths that weigh no cost of a round: a fixed k, and doubling for prompt lookup.

Prompt lookup drafts cost nothing to make and are all or nothing: a copied span runs on
for dozens of tokens, then breaks off. `DoublingLength` follows that: it doubles after a
whole draft was accepted and falls to one past what was accepted after a rejection. It is
what `auto` means for the n-gram drafter.

Pure: no model, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from drafter.length.chunk_pace import ChunkPace
from drafter.speculative.candidates import DraftLength, RoundTiming


@dataclass
class FixedLength(DraftLength):
    """k drafts a round. k = 0 (no drafting): every round is a chunk of the verifier's own
    tokens, paced by `ChunkPace`, so that asking for no drafts runs at the verifier's own
    speed rather than a round trip a token."""

    k: int
    max_chunk: int = field(default=1, compare=False)
    watched: bool = field(default=True, compare=False)
    _pace: ChunkPace = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._pace = ChunkPace(self.max_chunk, self.watched)

    def next(self, ahead: bool = False) -> int:
        return self.k

    def update(self, drafted: int, accepted_prefix_len: int) -> None:
        self._pace.answered(drafted == 0)

    def observe(self, timing: RoundTiming) -> None:
        """The verifier's time a token and the link's, for the chunks' pace."""
        self._pace.observe(timing.rows, timing.verifier_s, timing.round_trip_s, timing.steps)

    def chunk(self, paced: bool = False) -> int:
        if self.k and not paced:
            return 1
        return self._pace.measured_size(paced)

    @property
    def label(self) -> str:
        return str(self.k)


@dataclass
class DoublingLength(DraftLength):
    """x2 after a round whose whole draft was accepted; after a rejection, the accepted
    prefix plus one; within [minimum, maximum].

    Where the lookup finds nothing to draft and the verifier decodes chunks of its own
    tokens (`max_chunk` > 1), a chunk paced as a watched one is (`ChunkPace`): one token
    first, then CHUNK_S_FIRST of the verifier's time doubling while lookups keep missing,
    from the shortest again after a drafted round. A chunk's tokens are looked through
    only once it is answered, so a chunk is short where a match may come soon, and
    grows only where none has for a while; a round trip a token would cost more."""

    maximum: int
    start: int = 4
    minimum: int = 1
    max_chunk: int = 1
    _pace: ChunkPace = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.minimum <= self.maximum:
            raise ValueError("need 1 <= minimum <= maximum")
        self.k = min(max(self.start, self.minimum), self.maximum)
        self._pace = ChunkPace(self.max_chunk, watched=True)

    def next(self, ahead: bool = False) -> int:
        return self.k

    def chunk(self, paced: bool = False) -> int:
        return self._pace.measured_size(paced=True)

    def update(self, drafted: int, accepted_prefix_len: int) -> None:
        self._pace.answered(drafted == 0)
        if drafted == 0:
            return  # no draft (no match, or a round cut short): nothing learned
        self._pace.restart()
        after = 2 * self.k if accepted_prefix_len == drafted else accepted_prefix_len + 1
        self.k = min(max(after, self.minimum), self.maximum)

    def observe(self, timing: RoundTiming) -> None:
        self._pace.observe(timing.rows, timing.verifier_s, timing.round_trip_s, timing.steps)

    @property
    def label(self) -> str:
        return "auto"
