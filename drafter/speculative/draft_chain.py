"""The last chain a draft model drafted: when the committed tokens turn out to run along
it (pipelining drafted past the round in flight, and its guess of the target's token was
right), its tokens are the next draft without evaluating anything again."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class DraftChain:
    def __init__(self) -> None:
        self.start = 0  # how many committed tokens it followed
        self.links: list[tuple[int, np.ndarray | None]] = []  # (token, its q)

    def forget(self) -> None:
        self.start, self.links = 0, []

    def remember(self, start: int, tokens: Sequence[int], probs: Sequence) -> None:
        self.start, self.links = start, list(zip(tokens, probs, strict=True))

    def reusable(
        self, committed: Sequence[int], k: int, cached: Sequence[int]
    ) -> tuple[list[int], list]:
        """The part of the chain that follows `committed`, if `committed` runs along it
        and the cache (`cached`) still holds what it followed: exactly what drafting again
        from here would give (greedy), or a draw from the same q (sampled)."""
        n, start = len(committed), self.start
        if not self.links or not start <= n < start + len(self.links):
            return [], []
        if list(committed[start:]) != [t for t, _ in self.links][: n - start]:
            return [], []
        if list(cached[:start]) != list(committed[:start]):
            return [], []
        reused = self.links[n - start : n - start + k]
        return [t for t, _ in reused], [q for _, q in reused]
