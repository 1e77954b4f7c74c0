"""How many tokens a draft model drafts next round under `auto`: chosen from what the
generation has measured so far (fixed lengths and prompt lookup's: drafter/length/plain_lengths.py).

`LinkAwareLength` is what `auto` means for a draft model: a cost model of the round (the
acceptance, the verifier's time against its rows, the link's time, the drafting time,
and how often the next draft was ready when an answer came), so that one default drafts
short next to the verifier and long over a slow link.

Rounds without a draft (k = 0), where the verifier decodes chunks of its own tokens
(`max_chunk` > 1), ask for `chunk()` tokens (`ChunkPace`: `watched` or not). Chosen
from the start where the verifier advises 0 (`advise`: its rows cost as much
as the tokens they win, for this session and its load, server/verifier/decoding/advice.py),
and whenever the rate chunks gave (measured whole: under load a chunk's steps share
passes unevenly) beats the best draft's rate (measured, or expected before four
drafted rounds); k never exceeds the advice (at least `minimum`). While chunking, a
drafted round is sent now and then (after 4, 8, 16, ... chunks) to measure again
what only drafting shows, the acceptance the verifier advises from included; while
drafting where the verifier advises a draft, a short chunk now and then (after 4, 8,
16, ... drafted rounds) measures what chunks give, and chunks are sent once they
come faster (by CHUNK_MARGIN where other sessions share the passes:
`pass_sessions`). The round before any drafted one is a chunk (`drafts_soon`), for
the draft model to catch up meanwhile, not on the drafted round's path.

Pure: no model, no clock (the loop passes the times it measured).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from drafter.length.chunk_pace import ChunkPace
from drafter.length.measured_rate import (
    AHEAD_PRIOR,
    MeasuredRate,
    ProbeSchedule,
    chunk_margin,
    line_added,
    line_seconds,
    mixed_rate,
)
from drafter.speculative.candidates import DraftLength, RoundTiming
from server.shared.draft_gain import Acceptance, expected_tokens

# While the advice is not 0: chunks before a drafted round measures drafting again, from
# PROBE_FIRST, doubling after each probe that keeps the chunks, up to PROBE_LAST.
PROBE_FIRST = 4
PROBE_LAST = 64
# Where the verifier advises 0, the first probe waits longer: on an idle verifier a probe
# costs a round, and it mostly confirms the advice; under load it can show otherwise.
PROBE_FIRST_ADVISED_0 = 16


# While drafting where the verifier advises a draft: a round without a draft now and
# then (after CHUNK_PROBE_FIRST drafted rounds, doubling up to CHUNK_PROBE_LAST)
# measures what chunks give, which the verifier's advice does not weigh: it prices its
# own rows, not this drafter's time a token.
CHUNK_PROBE_FIRST = 4
CHUNK_PROBE_LAST = 256
# Drafted rounds measured before their rate is weighed against chunks': one round's
# tokens vary from one to k + 1.
MIN_DRAFTED_ROUNDS = 4


@dataclass
class LinkAwareLength(DraftLength):
    """The k with the most tokens per second expected from what this generation measured:
    per-token acceptance a (each round: accepted tokens and at most one rejection,
    counted with geometric weights so recent rounds count more), the verifier's time per
    round against its rows (a line fitted to the rounds so far), the link's time (round
    trip less the verifier's), the drafting time per token, and how often the next draft
    was ready when an answer came (speculation, drafter/speculative/speculation.py). A round of k is
    expected to commit (1 - a^(k+1)) / (1 - a) tokens in link + verifier(k + 1), plus
    k * draft time when the draft is made after the answer, and in no less than that when
    made ahead (before a drafted round measures it: `draft_s_prior`, which `serve` times
    as it warms the draft model up). So two lengths: `next()` for a
    draft made then (short on a slow CPU drafter: every token waits), `next(ahead=True)`
    for one made while the round is out (free to be longer: the wait pays for it). On a
    slow link both grow; next to the verifier they shrink (Leviathan et al., section 3.3,
    with the link added).
    Rounds without a draft: see the module's doc."""

    maximum: int
    start: int = 4
    minimum: int = 1
    decay: float = 0.9
    max_chunk: int = 1
    watched: bool = True
    k: int = 0
    _acceptance: Acceptance = field(default_factory=Acceptance)
    _fit: list[float] = field(default_factory=lambda: [0.0] * 5)  # n, x, y, xx, xy
    _step_s: float | None = None  # the verifier's time a token of a chunk
    k_ahead: int = 0
    _link_s: float | None = None
    _draft_s: float | None = None
    draft_s_prior: float | None = None  # a draft token's time, DraftModel.warm_up's
    _ahead_share: float = AHEAD_PRIOR  # of drafted rounds, those whose draft was ready
    advised: int | None = None  # the verifier's last advice (None: it gives none)
    pass_sessions: float | None = None  # sessions its passes hold (None: not told)
    chunking: bool = False
    _chunk_probes: ProbeSchedule = field(
        default_factory=lambda: ProbeSchedule(CHUNK_PROBE_FIRST, CHUNK_PROBE_LAST)
    )
    _probe_every: int = PROBE_FIRST
    _chunks_to_probe: int = PROBE_FIRST
    _pace: ChunkPace = field(init=False, repr=False)
    # Tokens a second that rounds without a draft gave, and drafted rounds (drafting
    # included), each measured whole.
    _chunk_rate: MeasuredRate = field(default_factory=lambda: MeasuredRate(min_rounds=1))
    _draft_rate: MeasuredRate = field(default_factory=lambda: MeasuredRate(MIN_DRAFTED_ROUNDS))

    def __post_init__(self) -> None:
        self.k = self.k_ahead = min(max(self.start, self.minimum), self.maximum)
        self._pace = ChunkPace(self.max_chunk, self.watched)

    @property
    def label(self) -> str:
        return "auto"

    def next(self, ahead: bool = False) -> int:
        if (self.chunking and self._chunks_to_probe > 0) or self._chunk_probe_due:
            return 0
        return self.k_ahead if ahead else self.k

    @property
    def _alone(self) -> bool:
        """This session's rounds have the verifier's passes to themselves, or nearly."""
        return self.pass_sessions is not None and self.pass_sessions < 2.0

    @property
    def _drafting_under_advice(self) -> bool:
        """And alone: where others share the passes, a chunk is priced at their pass."""
        return self._alone and not self.chunking and bool(self.advised) and self.max_chunk > 1

    @property
    def _chunk_probe_due(self) -> bool:
        return self._drafting_under_advice and self._chunk_probes.due

    def chunk_soon(self) -> bool:
        return self._drafting_under_advice and self._chunk_probes.soon

    @property
    def adaptive(self) -> bool:
        """A draft when it pays, so none while the draft model is not ready for one: the
        loop sends a round without a draft rather than wait for it (a fixed length waits)."""
        return True

    def drafts_soon(self) -> bool:
        """Whether the round after this chunk is a drafted one (a probe of drafts, or
        drafting again after a probe of chunks, unless that shows chunks faster)."""
        return (self.chunking and self._chunks_to_probe <= 1) or self._chunk_probe_due

    def chunk(self, paced: bool = False) -> int:
        """Tokens a round without a draft asks for (`ChunkPace`; a probe of chunks is
        paced: short, drafted rounds are to follow it)."""
        per_token = self._step_s or self.verifier_s(1)
        return self._pace.size(per_token, self._link_s or 0.0, paced or self._chunk_probe_due)

    def advise(self, advised: int | None, pass_sessions: float | None = None) -> None:
        self.advised = advised
        self.pass_sessions = pass_sessions if pass_sessions is not None else self.pass_sessions
        self._choose()

    def update(self, drafted: int, accepted_prefix_len: int) -> None:
        self._pace.answered(drafted == 0)
        if drafted == 0:
            if self.chunking:
                self._chunks_to_probe -= 1
            elif self._chunk_probe_due:  # this round was the probe of chunks
                self._chunk_probes.probed()
                self._pace.restart()  # the next probe as short
            return
        if not self.chunking:
            self._chunk_probes.counted()
            if self._chunk_probes.due:
                self._pace.restart()  # the probe as short as can be
        if self.chunking and self._chunks_to_probe <= 0:  # this round was a probe
            self._probe_every = min(2 * self._probe_every, PROBE_LAST)
            self._chunks_to_probe = self._probe_every
        self._acceptance = self._acceptance.after(drafted, accepted_prefix_len, self.decay)

    def observe(self, timing: RoundTiming) -> None:
        d = self.decay
        # Both kinds of round measured whole, as the user waits for them: under load, what
        # a round waits for is the other sessions' doing, which no model of rows shows.
        if timing.rows == 1 and timing.round_trip_s > 0:
            self._chunk_rate.add(timing.steps, timing.round_trip_s, d)
            self._draft_rate.fade(d)
        elif timing.rows > 1 and timing.round_trip_s > 0:
            self._draft_rate.add(timing.tokens, timing.round_trip_s + timing.draft_s, d)
            self._chunk_rate.fade(d)
        if timing.rows == 1 and timing.steps > 1:
            # A chunk's steps: a token each, timed when the chunk ran (the line of rows
            # below is drafted rounds' and single steps': a chunk run long ago under
            # another load would bend it for good).
            step = timing.verifier_s / timing.steps
            self._step_s = step if self._step_s is None else d * self._step_s + (1 - d) * step
        else:
            self._fit = line_added(self._fit, timing.rows, timing.verifier_s, d)
        if timing.steps == 1:
            # A chunk's round trip holds its steps' waits for passes too: not the link's.
            link = max(0.0, timing.round_trip_s - timing.verifier_s)
            self._link_s = link if self._link_s is None else d * self._link_s + (1 - d) * link
        if timing.rows > 1:
            self._ahead_share = d * self._ahead_share + (1 - d) * timing.drafted_ahead
        if timing.rows > 1 and not timing.drafted_ahead:
            # From the prior, where one was timed: a generation's first draft often finds
            # its logits ready (the prompt warmed), which later drafts do not.
            per_token, before = timing.draft_s / (timing.rows - 1), self._drafting_s
            self._draft_s = per_token if before is None else d * before + (1 - d) * per_token
        self._choose()

    def _choose(self) -> None:
        measured = self._fit[0] > 0  # before a drafted round: `start`, within the advice
        ceiling = self.maximum if self.advised is None else min(self.maximum, self.advised)
        ceiling = max(ceiling, self.minimum)
        if not measured:
            self.k = self.k_ahead = min(self.k, ceiling)
        else:
            self.k, self.k_ahead = self._best(False, ceiling), self._best(True, ceiling)
        was = self.chunking
        if self.max_chunk <= 1:
            self.chunking = False
        elif self.advised == 0:
            # The verifier's own tokens come faster than drafted ones would, before this
            # drafter's time and the link's: drafting cannot pay.
            self.chunking = True
        elif self.advised is not None:
            # A draft pays the verifier. Whether it pays this user too: what differs is
            # the link, paid once a chunk, and the drafting. The verifier has priced the
            # rows, so a round of any length costs what a round does now, and so does a
            # chunk's every step where other sessions fill the passes (the line of rows
            # run down to one row would price a step at a fraction of the pass it waits
            # for); alone, a step is a pass of one row, as chunks measured it (before
            # them, the line at one row, unless it reads none). Measured against measured
            # where both kinds were sent lately (chunks measured whole).
            flat = self.verifier_s(ceiling + 1)
            drafted = self._draft_rate.rate
            chunks = self._chunk_rate.rate if drafted is not None else None
            drafted = drafted or self.expected_drafting_per_s(flat)
            step = (self._step_s or self.verifier_s(1) or flat) if self._alone else flat
            chunks = chunks or self.chunk_tokens_per_s(step)
            self.chunking = measured and chunks > chunk_margin(self.pass_sessions) * drafted
        elif not measured:
            self.chunking = False
        else:  # a verifier that gives no advice: this session's own model of its rounds
            self.chunking = self.chunk_tokens_per_s() > self.expected_drafting_per_s()
        if was and not self.chunking and self._chunks_to_probe > 0:
            # Leaving chunks for drafts: one chunk more first, during which the draft
            # model catches up with the tokens chunks brought (`drafts_soon`).
            self.chunking, self._chunks_to_probe = True, 1
        if was and not self.chunking:  # chunks measured all along: no probe of them soon
            self._chunk_probes.put_off()
        elif self.chunking and not was:
            first = PROBE_FIRST_ADVISED_0 if self.advised == 0 else PROBE_FIRST
            self._probe_every = self._chunks_to_probe = first
            self._pace.restart()

    @property
    def acceptance(self) -> float:
        return self._acceptance.rate

    def verifier_s(self, rows: int) -> float:
        # One row count so far: where the verifier advises drafts, rows cost it little now.
        return line_seconds(self._fit, rows, flat=bool(self.advised))

    def expected_tokens_per_s(
        self, k: int, ahead: bool = False, verifier_s: float | None = None
    ) -> float:
        """`verifier_s`: the verifier's time for the round whatever k (else this
        session's line of it against its rows)."""
        tokens, seconds = self._expected_round(k, ahead, verifier_s)
        return tokens / seconds if seconds > 0 else 0.0

    def expected_drafting_per_s(self, verifier_s: float | None = None) -> float:
        """Drafted rounds as they come: drafted ahead as often as lately, else after the
        answer (the share measured from drafted rounds, AHEAD_PRIOR before them)."""
        ahead = self._expected_round(self.k_ahead, True, verifier_s)
        after = self._expected_round(self.k, False, verifier_s)
        return mixed_rate(self._ahead_share, ahead, after)

    def _expected_round(self, k: int, ahead: bool, verifier_s: float | None) -> tuple[float, float]:
        if verifier_s is None:
            verifier_s = self.verifier_s(k + 1)
        seconds = (self._link_s or 0.0) + verifier_s
        drafting = k * (self._drafting_s or 0.0)
        seconds = max(seconds, drafting) if ahead else seconds + drafting
        return expected_tokens(self.acceptance, k), seconds

    @property
    def _drafting_s(self) -> float | None:
        return self._draft_s if self._draft_s is not None else self.draft_s_prior

    def chunk_tokens_per_s(self, step_s: float | None = None) -> float:
        """Measured, or expected with `step_s` the verifier's time a token (else the
        chunks', or this session's line of it for one row)."""
        if step_s is None and self._chunk_rate.rate is not None:
            return self._chunk_rate.rate
        m = self.chunk()
        step_s = step_s if step_s is not None else (self._step_s or self.verifier_s(1))
        seconds = (self._link_s or 0.0) + m * step_s
        return m / seconds if seconds > 0 else 0.0

    def _best(self, ahead: bool, ceiling: int) -> int:
        # Where the verifier advises, it has priced the rows (its passes, its load: a
        # pass is as wide as its widest round, so a shorter round saves it little) and
        # this session weighs only what is its own: drafting and the link.
        verifier_s = None if not self.advised else self.verifier_s(ceiling + 1)
        candidates = range(self.minimum, ceiling + 1)
        return max(candidates, key=lambda k: self.expected_tokens_per_s(k, ahead, verifier_s))
