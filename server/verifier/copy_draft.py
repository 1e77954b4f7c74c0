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
a model's drafts are not), so where copies keep missing they stop. Pure.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any

from server.shared.draft_gain import Acceptance, expected_tokens
from server.shared.protocol import Strategy
from server.verifier.advice import NEAR_BEST, PassCost

# A repeat of this many tokens before a copy is made: llama.cpp's ngram-simple default.
COPY_NGRAM = 12
# Before a copy is judged: a = 0.9, as weak as a round or two (a long exact repeat goes on
# more often than not; one that does not shows it at once).
COPY_PRIOR = Acceptance(accepted=9.0, rejected=1.0)
TOKEN_BYTES = array("i").itemsize
# Strategies that judge a draft without the drafter's probabilities.
COPYABLE = (Strategy.greedy, Strategy.match)


def copy_draft(tokens: Sequence[int], ngram: int, limit: int) -> list[int]:
    """Up to `limit` tokens that followed the latest earlier occurrence of the last `ngram`
    tokens of `tokens`; [] where they occur nowhere earlier."""
    n = len(tokens)
    if limit <= 0 or ngram <= 0 or n <= ngram:
        return []
    # Searched as bytes, in C: every step of a chunk searches the session's whole text.
    # A match must start on a token's boundary; one that does not is skipped.
    text = array("i", tokens).tobytes()
    pattern = text[(n - ngram) * TOKEN_BYTES :]
    end = (n - 1) * TOKEN_BYTES  # an occurrence ends before the pattern itself does
    while (at := text.rfind(pattern, 0, end)) >= 0:
        if at % TOKEN_BYTES == 0:
            start = at // TOKEN_BYTES + ngram
            return list(tokens[start : start + limit])
        end = at + len(pattern) - 1
    return []


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


class ChunkCopier:
    """The copy a chunk's next step drafts: `ngram` 0 never copies."""

    def __init__(self, ngram: int, max_draft: int, n_ctx: int, pass_cost: PassCost):
        self.ngram, self.max_draft, self.n_ctx = ngram, max_draft, n_ctx
        self.pass_cost = pass_cost

    def for_step(self, session: Any, left: int) -> list[int]:
        """For a step of `session` (server.verifier.sessions.Session) whose chunk wants
        `left` tokens more, within its context: none under a grammar (its masks are
        computed before the round, for the draft it has) or a strategy that needs a
        drafter's probabilities, and no search where no copy could pay."""
        if not self.ngram or session.constraint is not None or session.strategy not in COPYABLE:
            return []
        limit = min(left - 1, self.max_draft, self.n_ctx - len(session.tokens))
        seconds, sharing = self.pass_cost.seconds(), self.pass_cost.sharing
        if copy_length(limit, session.copies, seconds, sharing) == 0:
            return []
        copy = copy_draft(session.tokens, self.ngram, limit)
        return copy[: copy_length(len(copy), session.copies, seconds, sharing)]
