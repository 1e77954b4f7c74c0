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

import ctypes
import ctypes.util
import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np

from server.shared.grammar_ends import never_ends
from server.shared.grammar_text import CheckTimeout, grammar_bounds, lark_of_gbnf
from server.shared.json_schemas import held_schema

# Kinds of grammar a request may give, and how each becomes llguidance's.
GRAMMAR_KINDS = ("json_schema", "lark", "gbnf", "regex")
TEMPLATES_KEPT = 32  # an owner's grammars compiled, the most recently used kept
REFUSALS_KEPT = 256  # grammars refused for a limit, answered again without compiling
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
    if kind == "json_schema" and isinstance(schema := _schema(source), dict):
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


class GrammarTooSlow(GrammarError):
    """A row's mask took longer than the session's grammar may take: the grammar is
    failed for good (every later round of the session is refused at once)."""


class Constraint:
    """One session's grammar state, at its committed tokens. Its masks are computed off
    the engine thread (`row_masks`, one round at a time: a session has one round in
    flight) and applied there (`apply_masks`), beside the commits: never at once."""

    def __init__(self, matcher: llguidance.LLMatcher, n_vocab: int, ends: frozenset[int]):
        self._matcher = matcher
        self.n_vocab = n_vocab
        self._ends = ends  # the tokens that end the text where the grammar may end
        self.failure: str | None = None  # why the grammar was failed for good
        self._deferred: list[int] = []  # committed by rounds, consumed by the next masks

    def row_masks(self, draft_tokens: Sequence[int], row_budget_s: float = 0.0) -> np.ndarray:
        """The allowed tokens of a round's rows (llguidance's bitmask, a row for the
        pending token and one per draft token), each after the draft tokens before it;
        rows after a draft token the grammar forbids allow everything (they are never
        read). A row that takes longer than `row_budget_s` (0: no limit) fails the grammar
        for good: `GrammarTooSlow`. The state is as it was after."""
        if self.failure is not None:
            raise GrammarError(self.failure)
        self._take_deferred(row_budget_s)
        rows = len(draft_tokens) + 1
        bitmask = np.full((rows, (self.n_vocab + 31) // 32), -1, dtype=np.int32)
        matcher, consumed = self._matcher, 0
        try:
            for row in range(rows):
                began = time.perf_counter()
                llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, row)
                spent = time.perf_counter() - began
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
        began = time.perf_counter()
        try:
            self.commit(tokens)
        except GrammarError as exc:
            self.failure = f"the grammar refused its committed tokens: {exc}"
            raise GrammarError(self.failure) from None
        spent = time.perf_counter() - began
        if budget_s and spent > budget_s * max(1, len(tokens)):
            self.failure = (
                f"the grammar took {spent * 1000:.0f} ms to take {len(tokens)} tokens, over "
                f"the limit of {budget_s * 1000:.0f} ms a token (VERIFIER_GRAMMAR_ROW_MS)"
            )
            raise GrammarTooSlow(self.failure)

    def commit(self, tokens: Sequence[int]) -> Callable[[], object]:
        """Advance the state by the round's committed tokens; returns what undoes it."""
        matcher, consumed = self._matcher, 0
        # One token a call: llguidance holds the GIL while it consumes, and an ambiguous
        # grammar's token can take milliseconds; between calls the engine thread and the
        # event loop run (a mask, unlike a consume, is computed without the GIL).
        for token in tokens:
            if matcher.try_consume_tokens([token]) != 1:
                break
            consumed += 1
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
        return lambda: matcher.rollback(consumed)

    @property
    def finished(self) -> bool:
        """Nothing more can follow (the grammar is complete and said so)."""
        return self._matcher.is_stopped()


@dataclass(frozen=True)
class GrammarLimits:
    """What compiling one grammar may cost (0: no limit): its time, with its first mask
    (where a grammar's lexer is built: a costly grammar pays there); the memory that took;
    and what one owner's compiled grammars may hold, in count and bytes, kept for its next
    sessions. Memory is what the process's heap holds allocated before and after, so
    compiles run one at a time where it is limited."""

    compile_s: float = 0.0
    grammar_bytes: int = 0
    kept_per_owner: int = TEMPLATES_KEPT
    bytes_per_owner: int = 0


@dataclass
class _Template:
    matcher: llguidance.LLMatcher
    nbytes: int


class Grammars:
    """Grammars compiled for one vocabulary: the first use of a grammar compiles it, later
    sessions of the same owner copy it. Each owner's compiled grammars are kept apart and
    bounded (`GrammarLimits`): one owner's never evict another's, and a grammar over a
    limit is refused (and remembered as refused). Thread-safe."""

    def __init__(
        self,
        tokenizer: Callable[[], llguidance.LLTokenizer],
        n_vocab: int,
        limits: GrammarLimits = GrammarLimits(),
    ):
        self._make_tokenizer = tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._ends: frozenset[int] = frozenset()
        self.n_vocab = n_vocab
        self.limits = limits
        self._templates: OrderedDict[tuple[str, str], _Template] = OrderedDict()
        self._refused: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()

    def constraint(self, kind: str, source: str | dict[str, Any], owner: str = "") -> Constraint:
        # The source exactly: a schema's keys are generated in its properties' order.
        key = (owner, hashlib.sha256(json.dumps([kind, source]).encode()).hexdigest())
        with self._lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
                return Constraint(template.matcher.deep_copy(), self.n_vocab, self._ends)
            if key in self._refused:
                raise GrammarError(self._refused[key])
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
                self._ends = frozenset(self._tokenizer.eos_tokens)
            tokenizer = self._tokenizer
        template = self._compiled(kind, source, tokenizer, key)
        with self._lock:
            self._keep(key, template)
        return Constraint(template.matcher.deep_copy(), self.n_vocab, self._ends)

    def held_bytes(self, owner: str) -> int:
        """What `owner`'s kept grammars took to compile, as measured."""
        with self._lock:
            return sum(t.nbytes for (o, _), t in self._templates.items() if o == owner)

    def _compiled(self, kind: str, source: str | dict[str, Any],
        tokenizer: llguidance.LLTokenizer, key: tuple[str, str]) -> _Template:  # fmt: skip
        # A refused grammar is raised from here, after its compile's frames are gone: a
        # traceback through them would keep its memory until the error is dropped, freed
        # then during a later compile, whose measure it would hide.
        template, failure, limited = self._measured(kind, source, tokenizer)
        if template is not None:
            return template
        assert failure is not None  # _measured gives a template or why not
        if limited:
            with self._lock:
                self._refused[key] = failure
                while len(self._refused) > REFUSALS_KEPT:
                    self._refused.popitem(last=False)
        raise GrammarError(failure)

    def _measured(
        self, kind: str, source: str | dict[str, Any], tokenizer: llguidance.LLTokenizer
    ) -> tuple[_Template | None, str | None, bool]:
        """(the compiled grammar, None, False); or (None, why not, whether over a limit)."""
        limits = self.limits
        before, began = allocated_bytes(), time.perf_counter()
        # What reads a grammar in Python holds the grammar thread: it stops at the limit.
        deadline = began + limits.compile_s if limits.compile_s else None
        try:
            grammar = compile_grammar(kind, source, deadline)
            # The schema as it was compiled: closing objects changes what can end.
            schema = held_schema(_schema(source)) if kind == "json_schema" else None
            if (reason := never_ends(kind, grammar, schema, deadline)) is not None:
                return None, reason, False
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
            if matcher.is_error():
                return None, matcher.get_error(), False
            # The first mask, here: it builds the lexer, the costly part of a costly
            # grammar, and shows a grammar that fails at its first token.
            Constraint(matcher, self.n_vocab, frozenset()).row_masks([])
        except GrammarError as exc:
            return None, str(exc), isinstance(exc, GrammarOverLimit)
        except CheckTimeout:
            pass  # past the compile limit before llguidance began: refused for it below
        seconds, nbytes = time.perf_counter() - began, max(0, allocated_bytes() - before)
        if limits.compile_s and seconds > limits.compile_s:
            return None, (
                f"the grammar took {seconds:.1f} s to compile, over the limit of "
                f"{limits.compile_s:g} s (VERIFIER_GRAMMAR_COMPILE_S)"
            ), True  # fmt: skip
        if limits.grammar_bytes and nbytes > limits.grammar_bytes:
            return None, (
                f"the compiled grammar takes {nbytes / 1e6:.0f} MB, over the limit of "
                f"{limits.grammar_bytes / 1e6:.0f} MB (VERIFIER_GRAMMAR_MAX_MB)"
            ), True  # fmt: skip
        return _Template(matcher, nbytes), None, False

    def _keep(self, key: tuple[str, str], template: _Template) -> None:
        """Under the lock: kept for the owner's next sessions, its oldest ones dropped
        while the owner holds more than its count or its bytes."""
        self._templates[key] = template
        self._templates.move_to_end(key)
        owner, limits = key[0], self.limits
        mine = [k for k in self._templates if k[0] == owner]
        held = sum(self._templates[k].nbytes for k in mine)
        while len(mine) > 1 and (
            len(mine) > limits.kept_per_owner
            or (limits.bytes_per_owner and held > limits.bytes_per_owner)
        ):
            oldest = mine.pop(0)
            held -= self._templates.pop(oldest).nbytes


def _schema(source: str | dict[str, Any]) -> Any:
    if not isinstance(source, str):
        return source
    try:
        return json.loads(source)
    except (ValueError, RecursionError):  # llguidance refuses it, or nests past json's reach
        return None


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in [
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        ]
    ]


def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):  # not glibc 2.33 or later (macOS, musl)
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _mallinfo2()


def allocated_bytes() -> int:
    """The bytes the process's heap holds allocated (glibc's `mallinfo2`, which llguidance's
    allocations go through; memory freed is counted out, unlike the resident size, which
    a later compile would reuse unseen); 0 where it cannot say."""
    if _MALLINFO2 is None:
        return 0
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)
