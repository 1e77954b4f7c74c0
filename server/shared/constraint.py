"""Constrained decoding: a grammar the logits rows are masked by, exact under
speculation, with llguidance (its matcher computes the allowed tokens after a grammar
state, for a position and for each draft token after it, and rolls back).

A round's row i follows the committed tokens and the round's first i drafts: it is masked
by the grammar's state after them. A draft token the grammar forbids has no probability
in its row, so it is rejected there (greedy: it is not the argmax; sampling: p = 0), and
the rows after it are never read. Once the round is judged, the committed tokens advance
the state. So the output is the verifier's own under the grammar, draft or no draft.

Why llguidance rather than llama.cpp's grammar sampler: it computes a row's mask against
the whole vocabulary in a fraction of the time (`scripts/bench_grammar.py` prints both),
which matters at k + 1 rows a round, and it can roll back (llama.cpp's sampler would be
cloned at every draft position).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np

from server.shared.grammar_text import grammar_bounds, lark_of_gbnf
from server.shared.json_schemas import held_schema

# What a grammar's time budgets are measured by (a test's own clock, in a test).
clock = time.perf_counter
# Kinds of grammar a request may give, and how each becomes llguidance's.
GRAMMAR_KINDS = ("json_schema", "lark", "gbnf", "regex")
# llguidance's own limits on a grammar's size and the work of one mask, but for its error
# messages, which would quote the client's grammar back into logs.
LIMITS = llguidance.LLParserLimits(verbose_errors=False)


# A matcher's stop reasons that end the text normally (the grammar complete, or a token
# limit of the grammar's own): past them only the end of the text is allowed.
STOPPED_WELL = frozenset(
    {
        "NotStopped",
        "EndOfSentence",
        "NoExtension",
        "NoExtensionBias",
        "MaxTokensTotal",
        "MaxTokensParser",
    }
)


class GrammarError(ValueError):
    """A grammar that does not compile, or a token it does not allow where it must."""


class GrammarOverLimit(GrammarError):
    """A grammar over a limit of its size: refused, and remembered as refused."""


def compile_grammar(kind: str, source: str | dict[str, Any], deadline: float | None = None) -> str:
    """llguidance's grammar for a request's (`json_schema` takes a schema object, held as
    server/shared/json_schemas.py holds one: objects closed, whitespace bounded); a Lark or
    GBNF grammar over a bound of its size refused unread, GBNF's past `deadline` too."""
    if kind not in GRAMMAR_KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r}: one of {', '.join(GRAMMAR_KINDS)}")
    if kind == "json_schema" and isinstance(schema := schema_of(source), dict):
        source = held_schema(schema)
    text = source if isinstance(source, str) else json.dumps(source)
    if (over := grammar_bounds(kind, text)) is not None:
        raise GrammarOverLimit(over)
    try:
        if kind == "gbnf":  # llguidance's own conversion is quadratic in its chains
            kind, text = "lark", lark_of_gbnf(text, deadline)
        return llguidance.grammar_from(kind, text)  # type: ignore[arg-type]
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


class TokenLimitReached(GrammarError):
    """A round of a session that has generated its `token_limit`."""


class GrammarTooSlow(GrammarError):
    """A row's mask took longer than the session's grammar may take: the grammar is
    failed for good (every later round of the session is refused at once)."""


class Constraint:
    """One session's grammar state, at its committed tokens. Its masks are computed off
    the engine thread (`row_masks`, one round at a time: a session has one round in
    flight) and applied there (`apply_masks`), beside the commits: never at once."""

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        n_vocab: int,
        ends: frozenset[int],
        token_limit: int | None = None,
    ):
        self._matcher = matcher
        self.n_vocab = n_vocab
        self._ends = ends  # the tokens that end the text where the grammar may end
        # The most tokens the session may generate (None: no limit but its context): the
        # grammar's own bound where the check could not prove it can end (grammar_ends.py).
        self.token_limit = token_limit
        self.generated = 0  # tokens the state has taken
        self.failure: str | None = None  # why the grammar was failed for good
        self._deferred: list[int] = []  # committed by rounds, consumed by the next masks

    def row_masks(self, draft_tokens: Sequence[int], row_budget_s: float = 0.0) -> np.ndarray:
        """The allowed tokens of a round's rows (llguidance's bitmask, a row for the
        pending token and one per draft token), each after the draft tokens before it;
        rows after a draft token the grammar forbids allow everything (they are never
        read); only the draft's first `draft_room` tokens have rows. A row that takes
        longer than `row_budget_s` (0: no limit) fails the grammar for good:
        `GrammarTooSlow`. The state is as it was after."""
        if self.failure is not None:
            raise GrammarError(self.failure)
        self._take_deferred(row_budget_s)
        draft_tokens = draft_tokens[: self.draft_room(len(draft_tokens))]
        rows = len(draft_tokens) + 1
        bitmask = np.full((rows, (self.n_vocab + 31) // 32), -1, dtype=np.int32)
        matcher, consumed = self._matcher, 0
        try:
            for row in range(rows):
                began = clock()
                llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, row)
                spent = clock() - began
                if row_budget_s and spent > row_budget_s:
                    self.failure = (
                        f"the grammar took {spent * 1000:.0f} ms for one token's mask, over "
                        f"the limit of {row_budget_s * 1000:.0f} ms (VERIFIER_GRAMMAR_ROW_MS)"
                    )
                    raise GrammarTooSlow(self.failure)
                self._check()
                if row == rows - 1 or matcher.try_consume_tokens([draft_tokens[row]]) != 1:
                    break
                consumed += 1
        finally:
            matcher.rollback(consumed)
        return bitmask

    def draft_room(self, drafted: int) -> int:
        """How many of a round's `drafted` tokens it may verify: all but where the session
        has a `token_limit`, there as many as leave room for the round's own token (a round
        commits at most its draft and one more). A round once the session has generated
        its limit: `TokenLimitReached`."""
        if self.token_limit is None:
            return drafted
        generated = self.generated + len(self._deferred)
        if generated >= self.token_limit:
            raise TokenLimitReached(
                f"the session has generated {generated} tokens, the most a session may "
                "generate under a grammar whose end the verifier cannot prove "
                "(VERIFIER_GRAMMAR_UNPROVEN_TOKENS)"
            )
        return min(drafted, self.token_limit - generated - 1)

    def apply_masks(self, logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
        """The rows with what the masks forbid at -inf (pure numpy: the engine's part)."""
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        allowed = allowed[: logits.shape[0], : min(logits.shape[1], self.n_vocab)].astype(bool)
        if allowed.shape[1] < logits.shape[1]:  # padding tokens past the grammar's vocabulary
            allowed = np.pad(allowed, ((0, 0), (0, logits.shape[1] - allowed.shape[1])))
        return np.where(allowed, logits, -np.inf).astype(logits.dtype, copy=False)

    def mask_rows(self, logits: np.ndarray, draft_tokens: Sequence[int]) -> np.ndarray:
        """A round's rows, each masked by the state after the draft tokens before it."""
        return self.apply_masks(logits, self.row_masks(draft_tokens))

    def _check(self) -> None:
        """A grammar past its limits (or broken) stops the matcher with a reason, not an
        error: either is the grammar's failure, never a silent end of the text."""
        matcher = self._matcher
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        reason = matcher.stop_reason()
        if reason not in STOPPED_WELL:
            raise GrammarError(f"the grammar stopped: {reason}")

    def defer(self, tokens: Sequence[int]) -> Callable[[], None]:
        """The round's committed tokens, for the next masks to consume (where they are
        computed, off the engine thread: consuming a token costs an ambiguous grammar as
        much as a mask); returns what undoes it. The masks allowed them, so they are
        taken; a grammar that refuses them there is failed."""
        self._deferred.extend(tokens)
        n = len(tokens)
        return lambda: self._deferred.__delitem__(slice(len(self._deferred) - n, None))

    def _take_deferred(self, budget_s: float) -> None:
        if not self._deferred:
            return
        tokens, self._deferred = self._deferred, []
        try:
            self.commit(tokens, budget_s)
        except GrammarTooSlow as exc:
            self.failure = str(exc)
            raise
        except GrammarError as exc:
            self.failure = f"the grammar refused its committed tokens: {exc}"
            raise GrammarError(self.failure) from None

    def commit(self, tokens: Sequence[int], budget_s: float = 0.0) -> Callable[[], object]:
        """Advance the state by the round's committed tokens; returns what undoes it.
        Past `budget_s` a token on average so far (0: no limit), undone: `GrammarTooSlow`."""
        matcher, consumed = self._matcher, 0
        began = clock()
        # One token a call: llguidance holds the GIL while it consumes, and an ambiguous
        # grammar's token can take milliseconds; between calls the engine thread and the
        # event loop run (a mask, unlike a consume, is computed without the GIL).
        for token in tokens:
            if matcher.try_consume_tokens([token]) != 1:
                break
            consumed += 1
            if budget_s and (spent := clock() - began) > budget_s * consumed:
                matcher.rollback(consumed)
                raise GrammarTooSlow(
                    f"the grammar took {spent * 1000:.0f} ms to take {consumed} of "
                    f"{len(tokens)} tokens, over the limit of {budget_s * 1000:.0f} ms a "
                    "token (VERIFIER_GRAMMAR_ROW_MS)"
                )
        taken = consumed
        # The end of the grammar's text is not consumed by trying: it is taken on its own
        # (a matcher that stopped already, with nothing left to write, takes it as is).
        if consumed == len(tokens) - 1 and tokens[-1] in self._ends and matcher.is_accepting():
            if matcher.is_stopped():
                taken += 1
            elif matcher.consume_token(tokens[-1]):
                consumed += 1
                taken += 1
        try:
            if taken < len(tokens):
                raise GrammarError(f"token {tokens[taken]} is not allowed by the grammar here")
            self._check()
        except GrammarError:
            matcher.rollback(consumed)
            raise
        self.generated += taken

        def undo() -> None:
            matcher.rollback(consumed)
            self.generated -= taken

        return undo

    @property
    def finished(self) -> bool:
        """Nothing more can follow (the grammar is complete and said so)."""
        return self._matcher.is_stopped()


def schema_of(source: str | dict[str, Any]) -> Any:
    if not isinstance(source, str):
        return source
    try:
        return json.loads(source)
    except (ValueError, RecursionError):  # llguidance refuses it, or nests past json's reach
        return None
