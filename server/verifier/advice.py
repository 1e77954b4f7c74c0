"""The draft length the verifier advises each session, from what a pass costs it.

A round of k drafts costs the verifier k + 1 rows in a pass and, when the draft's tokens
are accepted one after another with probability a, commits on average

    E(k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)

tokens (Leviathan et al., 2023). A pass costs a fixed part (every weight read once, the
kernels launched once) and a part per row: `PassCost` fits seconds = fixed + per_row * rows
to the passes of rounds the engine runs, recent passes weighted more. The fixed part is
shared by the sessions in a pass, so a session's round costs, in rows,

    fixed_rows / sharing + k + 1,   fixed_rows = fixed / per_row,

where `sharing` is how many sessions the recent passes of rounds held (1 when the
verifier is idle). The advice is the k that makes the most tokens per unit of that cost:
idle, the session's own tokens per second of the verifier; loaded, the server's goodput
(tokens per second of passes), since the session pays its share of each pass.

Where rows cost about what a pass costs (a CPU), E(k) / (k + 1) < 1 for every k > 0 and
the advice is 0: drafting cannot pay, however good the drafter. Where a pass costs many
rows (a GPU), the advice grows with the acceptance.

Pure: no clock, no threads (the engine feeds it its passes and rounds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Before any draft is seen: a = 0.75, as weak as one round.
PRIOR_ACCEPTED = 3.0
PRIOR_REJECTED = 1.0
ACCEPTANCE_DECAY = 0.9  # each round, the weight left to the rounds before it
PASS_DECAY = 0.98  # each pass, the weight left to the passes before it (about 50)
MAX_FIXED_ROWS = 1024.0  # rows that cost nothing measurable: the fixed part is all
SEED_WEIGHT = 4.0  # passes each of the probe's timings weighs as


@dataclass(frozen=True)
class Acceptance:
    """A session's per-token acceptance: accepted drafts against rejections, counted with
    weights that favour recent rounds."""

    accepted: float = PRIOR_ACCEPTED
    rejected: float = PRIOR_REJECTED

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def after(self, drafted: int, accepted_prefix_len: int) -> Acceptance:
        """The acceptance once a round of `drafted` tokens had `accepted_prefix_len` of
        them accepted (a round without a draft tells nothing)."""
        if drafted == 0:
            return self
        d = ACCEPTANCE_DECAY
        return Acceptance(
            d * self.accepted + accepted_prefix_len,
            d * self.rejected + (accepted_prefix_len < drafted),
        )


def expected_tokens(acceptance: float, k: int) -> float:
    """E(k): the tokens a round of k drafts commits on average."""
    a = min(max(acceptance, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


def advised_draft(acceptance: float, fixed_rows: float, sharing: float, max_draft: int) -> int:
    """The k in [0, max_draft] with the most tokens per row of cost (ties: the shorter)."""
    shared_rows = fixed_rows / max(sharing, 1.0)
    best_k, best = 0, 0.0
    for k in range(max_draft + 1):
        value = expected_tokens(acceptance, k) / (shared_rows + k + 1)
        if value > best * (1 + 1e-9):
            best_k, best = k, value
    return best_k


class PassCost:
    """seconds = fixed + per_row * rows, fitted to recent passes of rounds and to `seed`,
    the startup probe's timings of a session's round alone ((rows, seconds) pairs, each
    weighing as SEED_WEIGHT passes, for good): they settle the line while the passes run
    have one size only (chunks: one row each). With neither, `prior_fixed_rows` (None:
    unknown, and no advice)."""

    def __init__(self, prior_fixed_rows: float | None, seed: Sequence[tuple[int, float]] = ()):
        self.prior_fixed_rows = prior_fixed_rows
        self._seed = [0.0] * 5
        for rows, seconds in seed:
            self._seed = _added(self._seed, rows, seconds, SEED_WEIGHT)
        self._fit = [0.0] * 5  # weighted n, sum rows, sum seconds, sum rows^2, sum rows*s
        self.sharing = 1.0  # sessions a pass of rounds holds, recent passes weighted more

    def observe(self, rows: int, seconds: float, sessions: int) -> None:
        d = PASS_DECAY
        self._fit = _added([d * total for total in self._fit], rows, seconds, 1.0)
        self.sharing = d * self.sharing + (1 - d) * max(sessions, 1)

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per row), or None while the passes seen cannot tell."""
        n, x, y, xx, xy = (a + b for a, b in zip(self._fit, self._seed, strict=True))
        spread = n * xx - x * x
        if n < 2 or spread <= 1e-9 * max(n * xx, 1.0):
            return None
        per_row = (n * xy - x * y) / spread
        fixed = (y - per_row * x) / n
        return max(fixed, 0.0), per_row

    @property
    def fixed_rows(self) -> float | None:
        """The fixed part of a pass, in rows; None while nothing tells."""
        line = self.line()
        if line is None:
            return self.prior_fixed_rows
        fixed, per_row = line
        if per_row <= 0:
            return MAX_FIXED_ROWS
        return min(fixed / per_row, MAX_FIXED_ROWS)

    def advise(self, acceptance: Acceptance, max_draft: int) -> int | None:
        """The advised draft length; None while what a pass costs is unknown (no probe
        timings and passes of one size only)."""
        fixed_rows = self.fixed_rows
        if fixed_rows is None:
            return None
        return advised_draft(acceptance.rate, fixed_rows, self.sharing, max_draft)


def _added(sums: list[float], rows: int, seconds: float, weight: float) -> list[float]:
    n, x, y, xx, xy = sums
    return [
        n + weight,
        x + weight * rows,
        y + weight * seconds,
        xx + weight * rows * rows,
        xy + weight * rows * seconds,
    ]
