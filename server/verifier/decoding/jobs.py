"""The engine's units of work: a prompt being evaluated and a round being verified (each
begun, and either finished or undone), and the rows one of them puts into a pass."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from server.shared.protocol import PrefillResponse
from server.verifier.decoding.checks import RoundKey
from server.verifier.decoding.copy_draft import Copy
from server.verifier.kv.prompt_cuts import PromptCuts, Tiling
from server.verifier.kv.sessions import Reservation, Session


@dataclass(eq=False)
class PrefillWork:
    session: Session
    to_evaluate: list[int]  # the prompt but its last token (that one is the pending token)
    reservation: Reservation  # its sequence: how many tokens were reused, what made room
    tiling: Tiling = ()  # the positions it evaluates in tiled passes (prompt_cuts.py)
    evaluated: int = 0  # starts at the reused tokens: their cells were already there
    closed: bool = False  # finished or undone: nothing of it is left to run

    def __post_init__(self) -> None:
        self.evaluated = self.evaluated or self.reservation.reused

    @property
    def remaining(self) -> int:
        return len(self.to_evaluate) - self.evaluated

    def next_rows(self, cuts: PromptCuts, interleaved: bool) -> JobRows:
        """Its next piece, as `cuts` cut it (`interleaved`: while rounds wait), with the
        rows its pass is padded to."""
        n = cuts.piece(self.evaluated, self.tiling, len(self.to_evaluate), interleaved)
        piece = self.to_evaluate[self.evaluated : self.evaluated + n]
        rows = cuts.pass_rows(self.evaluated, self.tiling)
        return JobRows(self.session.seq_id, self.evaluated, piece, False, rows)


@dataclass(eq=False)
class VerifyWork:
    session: Session
    draft_tokens: list[int]
    draft_probs: list[np.ndarray] | None
    start: int  # position of the pending token
    round_key: RoundKey
    began: float = field(default_factory=time.perf_counter)
    closed: bool = False
    masks: np.ndarray | None = None  # the grammar's, computed before the round began
    copied: Copy | None = None  # its draft is the verifier's own copy, no client's
    advise: bool = True  # its answer carries advice (a chunk's steps do not: the chunk's does)
    # Its draft is the client's own (a round's, or a lookup's in a chunk's first step): cut
    # to share the verifier fairly (fair_share.py). Not the verifier's copies, nor a
    # chunk's later steps.
    client_drafted: bool = True
    lookup: bool = False  # its draft is a client's lookup (draft_kind): not a draft model's
    verified: int | None = None  # where the draft was cut to share a pass: what it kept

    def cut(self, keep: int) -> None:
        """Verify only the draft's first `keep` tokens (a prefix of a draft is judged as
        the whole is: the answer is the verifier's either way)."""
        self.draft_tokens = self.draft_tokens[:keep]
        if self.draft_probs is not None:
            self.draft_probs = self.draft_probs[:keep]
        if self.masks is not None:  # row i is the grammar's after the draft's first i tokens
            self.masks = self.masks[: keep + 1]
        self.verified = keep

    @property
    def tokens(self) -> list[int]:
        """What the round decodes: the pending token, then the draft (k + 1 rows)."""
        return [self.session.tokens[-1], *self.draft_tokens]


Work = PrefillWork | VerifyWork


@dataclass(frozen=True)
class Opened:
    """A prompt evaluated: the answer for the client, and the very session it opened
    (a cleanup ends that one, never another opened since under the same id)."""

    response: PrefillResponse
    session: Session
    reservation: Reservation


@dataclass(frozen=True, slots=True)
class JobRows:
    """A job's rows in a pass: `tokens` of sequence `seq_id` from position `start`, with
    their logits (a round) or without (a prompt chunk); a prompt chunk's pass padded to
    `min_rows` rows of its sequence (the padding's cells removed after)."""

    seq_id: int
    start: int
    tokens: Sequence[int]
    logits: bool
    min_rows: int = 0
