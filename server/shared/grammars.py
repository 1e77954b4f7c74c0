"""The grammars compiled for one vocabulary: the first use of a grammar compiles it
(server/shared/constraint.py), later sessions of the same owner copy it, within limits of
what compiling may cost."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llguidance

from server.shared.constraint import (
    LIMITS,
    Constraint,
    GrammarError,
    GrammarOverLimit,
    compile_grammar,
    schema_of,
)
from server.shared.grammar_ends import NEVER_ENDS, grammar_end
from server.shared.grammar_text import CheckTimeout
from server.shared.heap_bytes import allocated_bytes
from server.shared.json_schemas import held_schema

TEMPLATES_KEPT = 32  # an owner's grammars compiled, the most recently used kept
REFUSALS_KEPT = 256  # grammars refused for a limit, answered again without compiling
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GrammarLimits:
    """What compiling one grammar may cost (0: no limit): its time, with its first mask
    (where a grammar's lexer is built: a costly grammar pays there); the memory that took;
    and what one owner's compiled grammars may hold, in count and bytes, kept for its next
    sessions. Memory is what the process's heap holds allocated before and after, so
    compiles run one at a time where it is limited. And the tokens a session may generate
    under a grammar whose end the check cannot prove (grammar_ends.py)."""

    compile_s: float = 0.0
    grammar_bytes: int = 0
    kept_per_owner: int = TEMPLATES_KEPT
    bytes_per_owner: int = 0
    unproven_tokens: int = 0


@dataclass
class _Template:
    matcher: llguidance.LLMatcher
    nbytes: int
    token_limit: int | None = None  # where its end is unproven (GrammarLimits)

    def copy(self, n_vocab: int, ends: frozenset[int]) -> Constraint:
        return Constraint(self.matcher.deep_copy(), n_vocab, ends, self.token_limit)


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
        key = _key(kind, source, owner)
        with self._lock:
            kept = self._kept(key)
            if kept is not None:
                return kept
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
                self._ends = frozenset(self._tokenizer.eos_tokens)
            tokenizer = self._tokenizer
        template = self._compiled(kind, source, tokenizer, key)
        with self._lock:
            self._keep(key, template)
        return template.copy(self.n_vocab, self._ends)

    def kept(self, kind: str, source: str | dict[str, Any], owner: str = "") -> Constraint | None:
        """The grammar's state where `owner` has it compiled already (a copy; a grammar
        refused for a limit is refused again), without compiling: None where it has not."""
        key = _key(kind, source, owner)
        with self._lock:
            return self._kept(key)

    def _kept(self, key: tuple[str, str]) -> Constraint | None:
        """Under the lock."""
        template = self._templates.get(key)
        if template is not None:
            self._templates.move_to_end(key)
            return template.copy(self.n_vocab, self._ends)
        if key in self._refused:
            raise GrammarError(self._refused[key])
        return None

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
            schema = held_schema(schema_of(source)) if kind == "json_schema" else None
            if (ending := grammar_end(kind, grammar, schema, deadline)) == "never":
                return None, NEVER_ENDS, False
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
        token_limit = None
        if ending == "unknown":
            token_limit = limits.unproven_tokens or None
            log.info("a %s grammar whose end the check cannot prove: its sessions generate "
                "at most %s tokens", kind, token_limit or "their context's")  # fmt: skip
        return _Template(matcher, nbytes, token_limit), None, False

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


def _key(kind: str, source: str | dict[str, Any], owner: str) -> tuple[str, str]:
    # The source exactly: a schema's keys are generated in its properties' order.
    return (owner, hashlib.sha256(json.dumps([kind, source]).encode()).hexdigest())
