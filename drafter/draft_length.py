"""How many tokens to draft next round: fixed, or chosen from what the generation has
measured so far.

`LinkAwareLength` is what `auto` means for a draft model: a cost model of the round (the
acceptance, the verifier's time against its rows, the link's time, the drafting time,
and how often the next draft was ready when an answer came), so that one default drafts
short next to the verifier and long over a slow link.

Prompt lookup drafts cost nothing to make and are all or nothing: a copied span runs on
for dozens of tokens, then breaks off. `DoublingLength` follows that: it doubles after a
whole draft was accepted and falls to one past what was accepted after a rejection. It is
what `auto` means for the n-gram drafter.

Pure: no model, no clock (the loop passes the times it measured).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FixedLength:
    k: int

    def next(self, ahead: bool = False) -> int:
        return self.k

    def update(self, drafted: int, accepted_prefix_len: int) -> None:
        pass

    @property
    def label(self) -> str:
        return str(self.k)


@dataclass
class DoublingLength:
    """x2 after a round whose whole draft was accepted; after a rejection, the accepted
    prefix plus one; within [minimum, maximum]."""

    maximum: int
    start: int = 4
    minimum: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.minimum <= self.maximum:
            raise ValueError("need 1 <= minimum <= maximum")
        self.k = min(max(self.start, self.minimum), self.maximum)

    def next(self, ahead: bool = False) -> int:
        return self.k

    def update(self, drafted: int, accepted_prefix_len: int) -> None:
        if drafted == 0:
            return  # no draft (no match, or a round cut short): nothing learned
        after = 2 * self.k if accepted_prefix_len == drafted else accepted_prefix_len + 1
        self.k = min(max(after, self.minimum), self.maximum)

    @property
    def label(self) -> str:
        return "auto"


@dataclass
class RoundTiming:
    """What one round cost, as the loop measured it."""

    rows: int  # the verifier's rows for it (k + 1)
    verifier_s: float  # the verifier's own time for it (engine_ms)
    round_trip_s: float  # sent to answered, as the drafter saw it
    draft_s: float  # drafting done before it could be sent (the critical path)
    drafted_ahead: bool  # its draft was ready when the previous answer came


@dataclass
class LinkAwareLength:
    """The k with the most tokens per second expected from what this generation measured:
    per-token acceptance a (each round: accepted tokens and at most one rejection,
    counted with geometric weights so recent rounds count more), the verifier's time per
    round against its rows (a line fitted to the rounds so far), the link's time (round
    trip less the verifier's), the drafting time per token, and how often the next draft
    was ready when an answer came (speculation, drafter/speculation.py). A round of k is
    expected to commit (1 - a^(k+1)) / (1 - a) tokens in link + verifier(k + 1), plus
    k * draft time when the draft is made after the answer. So two lengths: `next()` for a
    draft made then (short on a slow CPU drafter: every token waits), `next(ahead=True)`
    for one made while the round is out (free to be longer: the wait pays for it). On a
    slow link both grow; next to the verifier they shrink (Leviathan et al., section 3.3,
    with the link added)."""

    maximum: int
    start: int = 4
    minimum: int = 1
    decay: float = 0.9
    k: int = 0
    _accepted: float = 3.0  # a weak prior: a = 0.75
    _rejected: float = 1.0
    _fit: list[float] = field(default_factory=lambda: [0.0] * 5)  # n, x, y, xx, xy
    k_ahead: int = 0
    _link_s: float | None = None
    _draft_s: float | None = None

    def __post_init__(self) -> None:
        self.k = self.k_ahead = min(max(self.start, self.minimum), self.maximum)

    @property
    def label(self) -> str:
        return "auto"

    def next(self, ahead: bool = False) -> int:
        return self.k_ahead if ahead else self.k

    def update(self, drafted: int, accepted_prefix_len: int) -> None:
        if drafted == 0:
            return
        self._accepted = self.decay * self._accepted + accepted_prefix_len
        self._rejected = self.decay * self._rejected + (accepted_prefix_len < drafted)

    def observe(self, timing: RoundTiming) -> None:
        d = self.decay
        n, x, y, xx, xy = self._fit
        r, v = timing.rows, timing.verifier_s
        self._fit = [d * n + 1, d * x + r, d * y + v, d * xx + r * r, d * xy + r * v]
        link = max(0.0, timing.round_trip_s - v)
        self._link_s = link if self._link_s is None else d * self._link_s + (1 - d) * link
        if timing.rows > 1 and not timing.drafted_ahead:
            per_token = timing.draft_s / (timing.rows - 1)
            self._draft_s = (
                per_token if self._draft_s is None else (d * self._draft_s + (1 - d) * per_token)
            )
        self.k, self.k_ahead = self._best(ahead=False), self._best(ahead=True)

    @property
    def acceptance(self) -> float:
        return self._accepted / (self._accepted + self._rejected)

    def verifier_s(self, rows: int) -> float:
        n, x, y, xx, xy = self._fit
        if n == 0:
            return 0.0
        spread = n * xx - x * x
        if spread < 1e-9:  # one row count so far: the time grows with rows as on a CPU
            return y / n * rows / max(x / n, 1.0)
        slope = max(0.0, (n * xy - x * y) / spread)
        return max(0.0, (y - slope * x) / n + slope * rows)

    def expected_tokens_per_s(self, k: int, ahead: bool = False) -> float:
        a = min(self.acceptance, 0.999)
        tokens = (1 - a ** (k + 1)) / (1 - a)
        seconds = (self._link_s or 0.0) + self.verifier_s(k + 1)
        if not ahead:
            seconds += k * (self._draft_s or 0.0)
        return tokens / seconds if seconds > 0 else 0.0

    def _best(self, ahead: bool) -> int:
        candidates = range(self.minimum, self.maximum + 1)
        return max(candidates, key=lambda k: self.expected_tokens_per_s(k, ahead))


DraftLength = FixedLength | DoublingLength | LinkAwareLength
