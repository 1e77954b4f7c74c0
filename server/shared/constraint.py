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

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np

# Kinds of grammar a request may give, and how each becomes llguidance's.
GRAMMAR_KINDS = ("json_schema", "lark", "gbnf", "regex")
TEMPLATES_KEPT = 64  # grammars compiled, the most recently used kept for new sessions
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


def compile_grammar(kind: str, source: str | dict[str, Any]) -> str:
    """llguidance's grammar for a request's (`json_schema` takes a schema object)."""
    if kind not in GRAMMAR_KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r}: one of {', '.join(GRAMMAR_KINDS)}")
    text = source if isinstance(source, str) else json.dumps(source)
    try:
        return llguidance.grammar_from(kind, text)  # type: ignore[arg-type]
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


class Constraint:
    """One session's grammar state, at its committed tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, n_vocab: int, ends: frozenset[int]):
        self._matcher = matcher
        self.n_vocab = n_vocab
        self._ends = ends  # the tokens that end the text where the grammar may end

    def mask_rows(self, logits: np.ndarray, draft_tokens: Sequence[int]) -> np.ndarray:
        """A round's rows, each masked by the state after the draft tokens before it
        (rows after a forbidden draft token are left as they are: never read)."""
        rows = logits.shape[0]
        words = (self.n_vocab + 31) // 32
        bitmask = np.full((rows, words), -1, dtype=np.int32)
        if draft_tokens:
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(
                _EXECUTOR, [(self._matcher, 0, list(draft_tokens))], bitmask
            )
        else:
            llguidance.numpy.fill_next_token_bitmask(self._matcher, bitmask, 0)
        self._check()
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        allowed = allowed[:, : min(logits.shape[1], self.n_vocab)].astype(bool)
        if allowed.shape[1] < logits.shape[1]:  # padding tokens past the grammar's vocabulary
            allowed = np.pad(allowed, ((0, 0), (0, logits.shape[1] - allowed.shape[1])))
        return np.where(allowed, logits, -np.inf).astype(logits.dtype, copy=False)

    def _check(self) -> None:
        """A grammar past its limits (or broken) stops the matcher with a reason, not an
        error: either is the grammar's failure, never a silent end of the text."""
        matcher = self._matcher
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        reason = matcher.stop_reason()
        if reason not in STOPPED_WELL:
            raise GrammarError(f"the grammar stopped: {reason}")

    def commit(self, tokens: Sequence[int]) -> Callable[[], None]:
        """Advance the state by the round's committed tokens; returns what undoes it."""
        matcher = self._matcher
        consumed = matcher.try_consume_tokens(list(tokens))
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


class Grammars:
    """Grammars compiled for one vocabulary: the first use of a grammar compiles it (a
    JSON schema takes milliseconds, a large one longer), later sessions copy it.
    Thread-safe: the verifier compiles in its text pool, off the engine thread, so that a
    new grammar never holds up other sessions' rounds."""

    def __init__(self, tokenizer: Callable[[], llguidance.LLTokenizer], n_vocab: int):
        self._make_tokenizer = tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._ends: frozenset[int] = frozenset()
        self.n_vocab = n_vocab
        self._templates: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def constraint(self, kind: str, source: str | dict[str, Any]) -> Constraint:
        # The source exactly: a schema's keys are generated in its properties' order.
        key = hashlib.sha256(json.dumps([kind, source]).encode()).hexdigest()
        with self._lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
                return Constraint(template.deep_copy(), self.n_vocab, self._ends)
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
                self._ends = frozenset(self._tokenizer.eos_tokens)
            tokenizer = self._tokenizer
        grammar = compile_grammar(kind, source)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        with self._lock:
            self._templates[key] = matcher
            while len(self._templates) > TEMPLATES_KEPT:
                self._templates.popitem(last=False)
        return Constraint(matcher.deep_copy(), self.n_vocab, self._ends)


_EXECUTOR = llguidance.LLExecutor(num_threads=1)
