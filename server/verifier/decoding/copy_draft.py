"""Copies inside a chunk: where a session's text repeats itself, the verifier drafts the
repeat for its own next step, as llama.cpp's server does with `--spec-type ngram-simple`.

A chunk (chunks.py) is a round without a client's draft that asks for several of the
verifier's own tokens, one step a pass. Where the session's last `ngram` tokens occurred
earlier in its own prompt and output, the tokens that followed them there are the step's
draft, verified in the same pass as the step's own token: a repeated passage comes in
long steps, at no round trip. The session's own text only, never another's: nothing is
pooled. The draft is judged as a client's is (greedy, or sample-and-match), so the tokens
are the verifier's own whatever it copies.

Whether a copy pays is the verifier's cost model's call (advice.py): a step of d copied
tokens costs a pass of d + 1 rows and commits E(d) tokens at the session's acceptance of
copies, counted apart from its client's drafts (a long exact repeat is near certain where
a model's drafts are not), so where copies keep missing they stop.

A repeat with edits (a file sent back with a name renamed, a paragraph with a word
changed) breaks a copy at each edit, and the `ngram` tokens after it are new text. There
the session keeps where its text left the source (`Session.copy_anchor`), and for a few
tokens a step looks for its last two tokens just past that point in the source and
copies on from there (`resync_source`): the repeat goes on after the edit at no round
trip, priced at its own acceptance (a guess after an edit goes on less surely than a
long exact repeat). Pure but for that anchor, kept on the session.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from server.shared.draft_gain import Acceptance, expected_tokens
from server.shared.protocol import Strategy
from server.shared.repeats import copy_source
from server.verifier.decoding.advice import NEAR_BEST, PassCost

# A repeat of this many tokens before a copy is made: llama.cpp's ngram-simple default.
COPY_NGRAM = 12
# Before a copy is judged: a = 0.9, as weak as a round or two (a long exact repeat goes on
# more often than not; one that does not shows it at once).
COPY_PRIOR = Acceptance(accepted=9.0, rejected=1.0)
# After a copy breaks off, how far past where it left the source its last tokens are looked
# for, beyond the tokens the text has come since (an edit that is shorter than what it
# replaced).
RESYNC_SLACK = 4
RESYNC_SPAN = 32  # tokens after a copy breaks off that a resync is looked for
# Tokens of the text a resync must find in the source: one alone is found by chance.
RESYNC_MATCH = 2
# Before a resync is judged: a = 0.75, as weak as a round. Its acceptance is its own
# (`Session.resyncs`): a guess after an edit goes on less surely than a 12-token repeat.
RESYNC_PRIOR = Acceptance(accepted=3.0, rejected=1.0)
# Strategies that judge a draft without the drafter's probabilities.
COPYABLE = (Strategy.greedy, Strategy.match)


def resync_source(tokens: Sequence[int], anchor: tuple[int, int] | None, span: int) -> int | None:
    """Where a copy goes on after an edit: `anchor` is (an index in the source, the text's
    position that stood for it: where the text left the source, or where a copy ended).
    Within `span` tokens of that position, the first occurrence of the text's last
    RESYNC_MATCH tokens in the source around the anchor, at most as far past it as the
    text has come plus RESYNC_SLACK (an edit of a few tokens: a name renamed, a word
    changed), in the text before that position; what follows it there. None elsewhere."""
    if anchor is None or span <= 0:
        return None
    source, position = anchor
    came = len(tokens) - position  # the text's tokens since
    if not 0 < came <= span or source >= position or len(tokens) < RESYNC_MATCH:
        return None
    tail = list(tokens[-RESYNC_MATCH:])
    first = max(source - RESYNC_MATCH + 1, 0)
    last = min(source + came + RESYNC_SLACK, position - 1 - RESYNC_MATCH)
    for j in range(first, last + 1):
        if list(tokens[j : j + RESYNC_MATCH]) == tail:
            return j + RESYNC_MATCH
    return None


def copy_length(
    copy_len: int, copies: Acceptance, seconds: Callable[[float], float] | None, sharing: float
) -> int:
    """How many of a copy's tokens to draft: the k with the most tokens per second of the
    pass where `sharing` sessions each have a row and only this one gains from its copy
    (the others' rounds are padded to its width, or split into a pass of their own):

        (sharing - 1 + E(k)) / t(sharing * (k + 1))

    0 unless a copy beats none by NEAR_BEST, else the shortest within NEAR_BEST of the
    best; 0 where the cost of a pass is not known yet."""
    if copy_len <= 0 or seconds is None:
        return 0
    sharing = max(sharing, 1.0)

    def value(k: int) -> float:
        gained = sharing - 1.0 + expected_tokens(copies.rate, k)
        return gained / max(seconds(sharing * (k + 1)), 1e-12)

    values = [value(k) for k in range(copy_len + 1)]
    best = max(values[1:])
    if best < (1 + NEAR_BEST) * values[0]:
        return 0
    return next(k for k in range(1, copy_len + 1) if values[k] >= (1 - NEAR_BEST) * best)


@dataclass(frozen=True, slots=True)
class Copy:
    """A step's copy: its tokens, and the index in the session's text they come from."""

    tokens: list[int]
    source: int
    resync: bool  # where a copy that broke off goes on (`resync_source`)


class ChunkCopier:
    """The copy a chunk's next step drafts: `ngram` 0 never copies; `resync` 0 never
    goes on with a copy that broke off."""

    def __init__(
        self, ngram: int, max_draft: int, n_ctx: int, pass_cost: PassCost, resync: int = 0,
        sizing: bool = True,
    ):  # fmt: skip
        self.ngram, self.max_draft, self.n_ctx = ngram, max_draft, n_ctx
        self.pass_cost, self.resync, self.sizing = pass_cost, resync, sizing

    @classmethod
    def of(cls, settings: Any, n_ctx: int, pass_cost: PassCost) -> ChunkCopier:
        """As a verifier's settings (server.verifier.settings.VerifierSettings) say."""
        ngram, resync = settings.chunk_copy_ngram, settings.chunk_copy_resync
        return cls(ngram, settings.max_draft, n_ctx, pass_cost, resync, settings.lookup_sizing)

    def for_step(self, session: Any, left: int) -> Copy | None:
        """For a step of `session` (server.verifier.kv.sessions.Session) whose chunk wants
        `left` tokens more, within its context: none under a grammar (its masks are
        computed before the round, for the draft it has) or a strategy that needs a
        drafter's probabilities, and no search where no copy could pay."""
        if not self.ngram or session.constraint is not None or session.strategy not in COPYABLE:
            return None
        limit = min(left - 1, self.max_draft, self.n_ctx - len(session.tokens))
        seconds, sharing = self.pass_cost.seconds(), self.pass_cost.sharing
        if copy_length(limit, session.copies, seconds, sharing) == 0:
            return None
        tokens, acceptance, resync = session.tokens, session.copies, False
        source = copy_source(tokens, self.ngram)
        if source is None:
            source = resync_source(tokens, session.copy_anchor, self.resync)
            acceptance, resync = session.resyncs, True
        if source is None:
            return None
        copy = tokens[source : source + limit]
        copy = copy[: copy_length(len(copy), acceptance, seconds, sharing)]
        return Copy(copy, source, resync) if copy else None

    def size_lookup(self, session: Any, request: Any) -> int | None:
        """How many tokens of a client's lookup draft (a VerifyRequest with draft_accept)
        to verify: priced as a copy is, at the client's estimate of its acceptance; the
        whole draft under a grammar (its masks are computed for it) or with sizing off.
        None: not sized."""
        if request.draft_accept is None:
            return None
        drafted = len(request.draft_tokens)
        if session.constraint is not None or not self.sizing:
            return drafted
        accept = Acceptance(accepted=request.draft_accept, rejected=1.0 - request.draft_accept)
        return copy_length(drafted, accept, self.pass_cost.seconds(), self.pass_cost.sharing)

    @staticmethod
    def answered(session: Any, copy: Copy, first: int, accepted: int) -> None:
        """A copied step answered (`first`: the position of its first copied token): the
        anchor a resync starts from is where the copy ended, or where the text left it;
        none after a resync that missed at once (it was a wrong guess)."""
        if copy.resync and not accepted:
            session.copy_anchor = None
        else:
            session.copy_anchor = (copy.source + accepted, first + accepted)
