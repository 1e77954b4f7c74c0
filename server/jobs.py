"""The engine's units of work: a prompt being evaluated, a round being verified, and a
job's share of one batch and what came of it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from server.errors import APIError
from server.protocol import PrefillResponse, VerifyResponse
from server.sessions import Session


@dataclass(eq=False)
class PrefillWork:
    session: Session
    to_evaluate: list[int]  # the prompt but its last token (that one is the pending token)
    evaluated: int = 0  # starts at `reused`: those tokens' cells were already there
    reused: int = 0  # taken from a cached prefix of the same API key
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


def check_slots(slots: Sequence[Slot], n_batch: int) -> None:
    """What a scheduler must never send the engine; refused before anything is touched."""
    seq_ids = [slot.work.session.seq_id for slot in slots]
    if len(set(seq_ids)) != len(seq_ids):
        raise ValueError(f"two jobs of one sequence in a batch: {seq_ids}")
    for slot in slots:
        work = slot.work
        if work.closed or (isinstance(work, VerifyWork) and work.session.work is not work):
            raise ValueError("a batch slot holds a job that is not open")
        if isinstance(work, VerifyWork) and slot.n_tokens != work.remaining:
            raise ValueError("a round is decoded whole")
        if isinstance(work, PrefillWork) and not 0 <= slot.n_tokens <= work.remaining:
            raise ValueError(f"a prompt chunk of {slot.n_tokens} of {work.remaining} tokens")
    if sum(slot.n_tokens for slot in slots) > n_batch:
        raise ValueError(f"the batch exceeds n_batch={n_batch}")
