"""The engine's units of work: a prompt being evaluated, a round being verified, and a
job's share of one batch and what came of it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from server.errors import APIError
from server.protocol import PrefillResponse, VerifyResponse
from server.sessions import Session


@dataclass(eq=False)
class PrefillWork:
    session: Session
    to_evaluate: list[int]  # the prompt but its last token (that one is the pending token)
    evaluated: int = 0
    closed: bool = False  # finished or undone: nothing of it is left to run

    @property
    def remaining(self) -> int:
        return len(self.to_evaluate) - self.evaluated


@dataclass(eq=False)
class VerifyWork:
    session: Session
    draft_tokens: list[int]
    draft_probs: list[np.ndarray] | None
    start: int  # position of the pending token
    round_key: tuple
    began: float = field(default_factory=time.perf_counter)
    closed: bool = False

    @property
    def remaining(self) -> int:
        return len(self.draft_tokens) + 1  # a round is decoded whole


Work = PrefillWork | VerifyWork


@dataclass(frozen=True)
class Slot:
    """A job's share of one batch: a whole round, or a chunk of a prompt."""

    work: Work
    n_tokens: int


@dataclass(frozen=True)
class Outcome:
    work: Work
    response: PrefillResponse | VerifyResponse | None = None  # None: a prompt not done yet
    error: APIError | None = None
