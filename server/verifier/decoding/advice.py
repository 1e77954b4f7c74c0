"""The draft length the verifier advises each session, from what a pass costs it.

A round of k drafts costs the verifier k + 1 rows in a pass and commits E(k) tokens on
average at the session's acceptance a (server/shared/draft_gain.py). What a pass of r
rows costs, t(r), is learned as a curve: `PassCost` keeps the mean time of the passes of
rounds it ran by size (recent passes weighted more), seeded with the startup probe's
timings (a round of one row and of a few alone, and every sequence's round in one pass),
and reads t(r) between them. The curve is not a line: on a CPU a pass of one row runs
other kernels than a pass of dozens, so a row added to a large pass costs a fraction of
a row alone; on a GPU t is nearly flat.

`sharing` is how many sessions the recent passes of rounds held (1 when the verifier is
idle). The advice is the k with the most tokens per second of passes when each of those
sessions sends k + 1 rows:

    E(k) / t(sharing * (k + 1))

idle, the session's own tokens per second of the verifier; loaded, the server's goodput.
Where a pass costs about its rows (a CPU, idle), E(k) / (k + 1) < 1 for every k > 0 and
the advice is 0: drafting cannot pay, however good the drafter. Where a pass costs many
rows more than its own (a GPU, or a CPU's large passes under load), the advice grows with
the acceptance.

Pure: no clock, no threads (the engine feeds it its passes and rounds).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence

from server.shared.draft_gain import Acceptance, expected_tokens

POOL_DECAY = 0.99  # the same, for the acceptance of every session's rounds together
PASS_DECAY = 0.98  # each pass, the weight left to the passes before it (about 50)
# Lengths whose value is this near the best count as the best, and the shortest of them
# is advised: the curve and the acceptance are estimates, and a longer draft costs what
# the curve does not see (the drafter's time a token, a longer wait for every session in
# the pass). Sessions sharing passes keep a shorter advice they hold until it is
# HOLD_SHORTER from the best (a pass is as wide as its widest round, so advice that
# flickers between two lengths pads every session's round), and leave a longer one as
# soon as a shorter is near.
NEAR_BEST = 0.03
HOLD_SHORTER = 0.06
# How many sessions a pass holds: up at once with a fuller pass, down as an average of
# the recent ones (a few thin passes, while sessions' rounds are on their way, are not
# the load falling).
SHARING_DECAY = 0.98
MAX_FIXED_ROWS = 1024.0  # rows that cost nothing measurable: the fixed part is all
SEED_WEIGHT = 4.0  # passes each of the probe's timings weighs as
BUCKETS_PER_DOUBLING = 2  # passes of about the same size share a point of the curve
MIN_WEIGHT = 0.5  # a point that has faded below this many passes is dropped


def advised_draft(
    acceptance: float,
    seconds: Callable[[float], float],
    sharing: float,
    max_draft: int,
    keep: int | None = None,
) -> int:
    """The k in [0, max_draft] with the most tokens per second of passes where `sharing`
    sessions send k + 1 rows each and a pass of r rows takes `seconds(r)`: 0 if it beats
    every draft by NEAR_BEST, or is that near and the session is alone (or `keep` is 0);
    else the shortest draft within NEAR_BEST of the best draft, or `keep` if it is
    shorter still and within HOLD_SHORTER."""
    sharing = max(sharing, 1.0)
    values = [
        expected_tokens(acceptance, k) / max(seconds(sharing * (k + 1)), 1e-12)
        for k in range(max_draft + 1)
    ]
    if max_draft < 1:
        return 0
    # Near a tie between no draft and a draft: alone, no draft (the session's user is
    # then never slower than the verifier alone); sharing passes, a draft, unless no
    # draft is held already (a chunk of the verifier's own tokens keeps a row in several
    # passes of other sessions' rounds, which the curve does not price).
    drafted = max(values[1:])
    alone = sharing < 2.0
    if values[0] > drafted * (1 + NEAR_BEST) or (
        (alone or keep == 0) and values[0] >= drafted * (1 - NEAR_BEST)
    ):
        return 0
    shortest = next(k for k in range(1, max_draft + 1) if values[k] >= drafted * (1 - NEAR_BEST))
    if keep is not None and 0 < keep < shortest and values[keep] >= drafted * (1 - HOLD_SHORTER):
        return keep
    return shortest


def line_seconds(fixed_rows: float) -> Callable[[float], float]:
    """A pass that costs `fixed_rows` rows more than its own, in units of one row."""
    return lambda rows: fixed_rows + rows


class PassCost:
    """t(rows): the mean seconds of the passes of rounds seen, by size (about
    BUCKETS_PER_DOUBLING sizes a doubling, each pass weighing PASS_DECAY less with each
    pass after it), and of `seed`, the startup probe's timings ((rows, seconds) pairs,
    each weighing as SEED_WEIGHT passes, for good), read by straight lines between the
    points and past the last. With fewer than two points, the line of
    `prior_fixed_rows` (None: unknown, and no advice)."""

    def __init__(self, prior_fixed_rows: float | None, seed: Sequence[tuple[int, float]] = ()):
        self.prior_fixed_rows = prior_fixed_rows
        self._seed: dict[int, list[float]] = {}  # bucket -> [weight, sum rows, sum seconds]
        for rows, seconds in seed:
            _add(self._seed, rows, seconds, SEED_WEIGHT)
        self._seen: dict[int, list[float]] = {}
        self.sharing = 1.0  # sessions a pass of rounds holds, recent passes weighted more
        # t(rows) as the points stand, kept until the next pass: read several times a
        # pass (the advice, a chunk's copy, the metrics), which is the engine's hot path.
        self._seconds: Callable[[float], float] | None = None
        self._stale = True

    def observe(self, rows: int, seconds: float, sessions: int) -> None:
        self._stale = True
        d = PASS_DECAY
        for bucket in list(self._seen):
            sums = self._seen[bucket] = [d * total for total in self._seen[bucket]]
            if sums[0] < MIN_WEIGHT / 10:
                del self._seen[bucket]
        _add(self._seen, rows, seconds, 1.0)
        sessions = max(sessions, 1)
        fading = SHARING_DECAY * self.sharing + (1 - SHARING_DECAY) * sessions
        self.sharing = max(float(sessions), fading)

    def points(self) -> list[tuple[float, float]]:
        """(rows, seconds) of each size seen or probed, by rows, never falling."""
        out: list[tuple[float, float]] = []
        for bucket in sorted(set(self._seed) | set(self._seen)):
            w, x, y = (
                a + b
                for a, b in zip(
                    self._seed.get(bucket, [0.0] * 3),
                    self._seen.get(bucket, [0.0] * 3),
                    strict=True,
                )
            )
            if w >= MIN_WEIGHT:
                out.append((x / w, max(y / w, out[-1][1] if out else 0.0)))
        return out

    def seconds(self) -> Callable[[float], float] | None:
        """t(rows), or None while nothing tells."""
        if self._stale:
            self._seconds, self._stale = self._curve(), False
        return self._seconds

    def _curve(self) -> Callable[[float], float] | None:
        points = self.points()
        if len(points) < 2:
            return None if self.prior_fixed_rows is None else line_seconds(self.prior_fixed_rows)
        xs = [x for x, _ in points]
        return lambda rows: _read(points, rows, xs)

    @property
    def fixed_rows(self) -> float | None:
        """What a pass of the current size costs beyond its rows, in rows of the passes
        around it: the part its sessions share. None while nothing tells."""
        seconds = self.seconds()
        if seconds is None:
            return None
        rows = max(self.sharing, 1.0)
        per_row = seconds(2 * rows) - seconds(rows)
        if per_row <= 0:
            return MAX_FIXED_ROWS
        return min(max(seconds(rows) * rows / per_row - rows, 0.0), MAX_FIXED_ROWS)


class Advisor:
    """The advice for a session: from its own acceptance where it is alone; where two
    sessions or more share the passes, from the acceptance of every round of its owner's
    sessions together (in between, a mix), so that one owner's sessions sharing a pass
    are advised alike. A pass is as wide as its widest round (narrower ones are padded to
    it, or split off into a pass of their own), so rounds of one length fill it best.
    Pooled per owner (API key): one key's drafts, rejected or marked as sure, never move
    the advice another key gets."""

    def __init__(self, cost: PassCost):
        self.cost = cost
        self._pools: dict[str, Acceptance] = {}
        self._shared: dict[str, int | None] = {}  # the last advice given from a pool alone

    def pool(self, owner: str) -> Acceptance:
        return self._pools.get(owner, Acceptance())

    def count(self, owner: str, drafted: int, accepted_prefix_len: int) -> None:
        self._pools[owner] = self.pool(owner).after(drafted, accepted_prefix_len, POOL_DECAY)

    def advise(
        self, acceptance: Acceptance, max_draft: int, last_draft: int = 0, owner: str = ""
    ) -> int | None:
        """The advised draft length for a session whose last drafted round had
        `last_draft` drafts (0: none yet); None while what a pass costs is unknown (no
        probe timings and passes of one size only). It grows at most to twice the last
        draft and one: while load rises (sessions opening one after another) what a pass
        holds lags behind, and a long draft advised for a pass of few sessions would
        land in a full one."""
        seconds = self.cost.seconds()
        if seconds is None:
            return None
        sharing = max(self.cost.sharing, 1.0)
        own = min(max(2.0 - sharing, 0.0), 1.0)  # alone: 1; two sessions a pass or more: 0
        pool = self.pool(owner).rate
        if own > 0:
            rate = own * acceptance.rate + (1 - own) * pool
            advised = advised_draft(rate, seconds, sharing, max_draft)
        else:
            held = self._shared.get(owner)
            advised = self._shared[owner] = advised_draft(pool, seconds, sharing, max_draft, held)
        return min(advised, 2 * last_draft + 1)


def _add(buckets: dict[int, list[float]], rows: int, seconds: float, weight: float) -> None:
    bucket = round(BUCKETS_PER_DOUBLING * math.log2(max(rows, 1)))
    w, x, y = buckets.get(bucket, [0.0, 0.0, 0.0])
    buckets[bucket] = [w + weight, x + weight * rows, y + weight * seconds]


def _read(points: Sequence[tuple[float, float]], rows: float, xs: Sequence[float]) -> float:
    """The straight line between the two points around `rows` (the last two past the
    end); below the first point, its time in proportion to the rows. `xs`: the points'
    rows."""
    x0, y0 = points[0]
    if rows <= x0:
        return y0 * rows / x0
    i = bisect.bisect_left(xs, rows)
    i = min(max(i, 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    slope = (y1 - y0) / (x1 - x0) if x1 > x0 else 0.0
    return max(y0 + slope * (rows - x0), 0.0)
