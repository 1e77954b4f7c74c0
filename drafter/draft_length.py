"""How many tokens to draft next round: fixed, or learned from the session's acceptance.

The adaptive rule is HF transformers' "heuristic" schedule (AssistedCandidateGenerator):
every draft accepted whole earns two more tokens next round, any rejection costs one.
Measured here against confidence cut-offs (llama.cpp's p_min, fixed at 0.5 and 0.75, and
one whose threshold followed the session's measured costs): on this project's CPU pair
the schedule held up best across network delays; see the README's Performance section.

Prompt lookup drafts cost nothing to make and are all or nothing: a copied span runs on
for dozens of tokens, then breaks off. `DoublingLength` follows that: it doubles after a
whole draft was accepted and falls to one past what was accepted after a rejection. It is
what `auto` means for the n-gram drafter (measured in the README against HF's schedule).
Pure: no model, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FixedLength:
    k: int

    def next(self) -> int:
        return self.k

    def update(self, drafted: int, accepted_prefix_len: int) -> None:
        pass

    @property
    def label(self) -> str:
        return str(self.k)


@dataclass
class _LearnedLength:
    """A k within [minimum, maximum], starting at `start`, moved by each round's outcome."""

    maximum: int
    start: int = 4
    minimum: int = 1

    lowest_minimum = 0  # the smallest `minimum` the schedule can work with

    def __post_init__(self) -> None:
        if not self.lowest_minimum <= self.minimum <= self.maximum:
            raise ValueError(f"need {self.lowest_minimum} <= minimum <= maximum")
        self.k = min(max(self.start, self.minimum), self.maximum)

    def next(self) -> int:
        return self.k

    def update(self, drafted: int, accepted_prefix_len: int) -> None:
        if drafted == 0:
            return  # no draft (no match, or a round cut short): nothing learned
        self.k = min(max(self._after(drafted, accepted_prefix_len), self.minimum), self.maximum)

    def _after(self, drafted: int, accepted_prefix_len: int) -> int:
        raise NotImplementedError

    @property
    def label(self) -> str:
        return "auto"


@dataclass
class AdaptiveLength(_LearnedLength):
    """+2 after a round whose whole draft was accepted, -1 after a rejection."""

    grow: int = 2
    shrink: int = 1

    def _after(self, drafted: int, accepted_prefix_len: int) -> int:
        if accepted_prefix_len == drafted:
            return self.k + self.grow
        return self.k - self.shrink


@dataclass
class DoublingLength(_LearnedLength):
    """x2 after a round whose whole draft was accepted; after a rejection, the accepted
    prefix plus one."""

    lowest_minimum = 1

    def _after(self, drafted: int, accepted_prefix_len: int) -> int:
        if accepted_prefix_len == drafted:
            return 2 * self.k
        return accepted_prefix_len + 1


DraftLength = FixedLength | AdaptiveLength | DoublingLength
