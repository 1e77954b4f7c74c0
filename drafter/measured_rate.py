"""Tokens a second over recent rounds of one kind, for `auto`'s choice between drafted
rounds and rounds without a draft (drafter/draft_length.py). Pure."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MeasuredRate:
    """Tokens a second over recent rounds: their tokens over their time, each summed with
    geometric weights (a sum's ratio: one slow round of many tokens weighs as it should).
    Rounds of the other kind age it too (`fade`): a rate measured before the link or the
    load changed is forgotten while the other kind is sent. None until `min_rounds`
    rounds are in, and once it weighs less than one recent round."""

    min_rounds: int
    tokens: float = 0.0
    seconds: float = 0.0
    rounds: int = 0
    weight: float = 0.0

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.fade(decay)
        self.tokens += tokens
        self.seconds += seconds
        self.weight += 1.0
        self.rounds += 1

    def fade(self, decay: float) -> None:
        self.tokens *= decay
        self.seconds *= decay
        self.weight *= decay

    @property
    def rate(self) -> float | None:
        if self.rounds < self.min_rounds or self.weight < 1.0 or self.seconds <= 0:
            return None
        return self.tokens / self.seconds
