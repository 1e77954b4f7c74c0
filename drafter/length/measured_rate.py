"""What `auto` measures to choose between drafted rounds and rounds without a draft
(drafter/length/draft_length.py): tokens a second over recent rounds of one kind, and when to
send a round of the other kind to measure it again. Pure."""

from __future__ import annotations

from dataclasses import dataclass

# Where the verifier advises a draft, how much faster chunks must look for auto to send
# them while its passes hold other sessions' rounds: a session sending chunks among
# drafted rounds costs every other session of the pass (its row is padded to their
# width, and it keeps passes running while their rounds are on their way). Alone, a
# chunk costs nobody else: chunks are sent as soon as they come faster.
CHUNK_MARGIN = 1.5
# The share of drafted rounds whose draft was made while the round before was out, before
# any has shown it: a draft made ahead is for the likeliest answers, and a rejection often
# answers otherwise, after which the next draft waits for the draft model.
AHEAD_PRIOR = 0.5


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


@dataclass
class ProbeSchedule:
    """Rounds of one kind between probes of the other: `first`, then twice as many after
    each probe, up to `last`."""

    first: int
    last: int
    every: int = 0
    left: int = 0  # rounds of this kind before the next probe

    def __post_init__(self) -> None:
        self.every = self.left = self.first

    @property
    def due(self) -> bool:
        return self.left <= 0

    @property
    def soon(self) -> bool:
        """The round out now is the last before a probe."""
        return self.left <= 1

    def counted(self) -> None:
        self.left -= 1

    def probed(self) -> None:
        self.every = min(2 * self.every, self.last)
        self.left = self.every

    def put_off(self) -> None:
        """A whole interval again, as long as the last (the other kind measured lately)."""
        self.left = self.every


def chunk_margin(pass_sessions: float | None) -> float:
    """How much faster chunks must come than drafted rounds: CHUNK_MARGIN where the
    verifier's passes hold other sessions' rounds (or it does not say), none where this
    session has them to itself."""
    if pass_sessions is None:
        return CHUNK_MARGIN
    shared = min(max(pass_sessions - 1.0, 0.0), 1.0)
    return 1.0 + (CHUNK_MARGIN - 1.0) * shared


def mixed_rate(ahead_share: float, ahead: tuple[float, float], after: tuple[float, float]) -> float:
    """Tokens a second of drafted rounds, `ahead_share` of which find their draft made
    while the round before was out (`ahead`: a round's expected tokens and seconds) and
    the rest draft after the answer (`after`): the user waits for those drafts."""
    tokens = ahead_share * ahead[0] + (1 - ahead_share) * after[0]
    seconds = ahead_share * ahead[1] + (1 - ahead_share) * after[1]
    return tokens / seconds if seconds > 0 else 0.0


def line_added(fit: list[float], rows: int, seconds: float, decay: float) -> list[float]:
    """The sums (n, x, y, xx, xy) of a line of seconds against rows fitted by least
    squares, the rounds before weighing `decay` less, with one more round."""
    n, x, y, xx, xy = fit
    return [
        decay * n + 1,
        decay * x + rows,
        decay * y + seconds,
        decay * xx + rows * rows,
        decay * xy + rows * seconds,
    ]


def line_seconds(fit: list[float], rows: int, flat: bool) -> float:
    """The line's seconds at `rows` (0 before any round). Rounds of one row count so far:
    their mean, `flat`, else growing with the rows, as on a CPU."""
    n, x, y, xx, xy = fit
    if n == 0:
        return 0.0
    spread = n * xx - x * x
    if spread < 1e-9:
        return y / n if flat else y / n * rows / max(x / n, 1.0)
    slope = max(0.0, (n * xy - x * y) / spread)
    return max(0.0, (y - slope * x) / n + slope * rows)
