"""What `auto` measured in a `serve` slot's earlier generations, carried to its next one:
the verifier's time against the rows of a round and a chunk's time a token, the link's
time, the draft model's time a draft token, how often a draft was ready when an answer
came, and the tokens a second each kind of round gave. These are the machine's, the
link's and the load's, not the text's: a generation that starts from them need not pay
again to learn them (drafted rounds sent where the verifier advises a draft, until their
measured rate shows chunks faster). The acceptance is the text's, and starts afresh.
What changes meanwhile (the load, the link) is learned as before: each round ages what
came before it, and the kind not sent is probed now and then (drafter/length/draft_length.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from drafter.length.draft_length import LinkAwareLength
from drafter.length.measured_rate import MeasuredRate
from drafter.speculative.candidates import RoundTiming


@dataclass
class LengthMemory:
    """One slot's measurements, as its last generation left them (none yet: empty)."""

    fit: list[float] = field(default_factory=list)  # the verifier's time against rows
    step_s: float | None = None
    link_s: float | None = None
    draft_s: float | None = None
    ahead_share: float | None = None
    chunk_rate: MeasuredRate | None = None
    draft_rate: MeasuredRate | None = None


@dataclass
class RememberingLength(LinkAwareLength):
    """`auto` that starts from, and keeps up, a slot's `LengthMemory`."""

    memory: LengthMemory = field(default_factory=LengthMemory)

    def __post_init__(self) -> None:
        super().__post_init__()
        m = self.memory
        if m.fit:
            self._fit = list(m.fit)
        self._step_s, self._link_s, self._draft_s = m.step_s, m.link_s, m.draft_s
        if m.ahead_share is not None:
            self._ahead_share = m.ahead_share
        if m.chunk_rate is not None and m.draft_rate is not None:
            self._chunk_rate, self._draft_rate = replace(m.chunk_rate), replace(m.draft_rate)

    def observe(self, timing: RoundTiming) -> None:
        super().observe(timing)
        m = self.memory
        m.fit, m.step_s, m.link_s, m.draft_s, m.ahead_share = (
            list(self._fit),
            self._step_s,
            self._link_s,
            self._draft_s,
            self._ahead_share,
        )
        m.chunk_rate, m.draft_rate = replace(self._chunk_rate), replace(self._draft_rate)
