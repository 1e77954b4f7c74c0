"""A new session's decoding rules, set once at its prefill: its grammar's state (compiled
once per grammar, a copy for each session), the ids its biases name, and for a session
opened again by its client, where its prompt ends and its output begins."""

from __future__ import annotations

from collections.abc import Sequence

from server.shared.constraint import Constraint, GrammarError, Grammars
from server.shared.protocol import GenerateRequest, Grammar, PrefillRequest
from server.verifier.checks import check_generated, check_token_ids
from server.verifier.errors import InvalidGrammar


def session_constraint(grammars: Grammars, grammar: Grammar | None) -> Constraint | None:
    """The grammar's state for a new session (compiled at its first use, a copy after: the
    service compiles it off the engine thread first). Thread-safe."""
    if grammar is None:
        return None
    try:
        return grammars.constraint(grammar.kind, grammar.source)
    except GrammarError as exc:
        raise InvalidGrammar(f"grammar: {exc}") from None


def decoding_rules(
    request: PrefillRequest,
    prompt_ids: Sequence[int],
    grammars: Grammars,
    constraint: Constraint | None = None,
) -> tuple[int, Constraint | None]:
    """A new session's prompt length (a reopened session's generated tokens taken off)
    and grammar state after those tokens (`constraint`: prepared already, by
    `prepared_constraint`; else made here from `grammars`); its biases' ids checked."""
    check_token_ids(list(request.sampling.logit_bias), grammars.n_vocab, "logit_bias")
    prompt_len = check_generated(len(prompt_ids), request.generated_tokens)
    if constraint is None:
        constraint = prepared_constraint(grammars, request, prompt_ids)
    return prompt_len, constraint


def prepared_constraint(
    grammars: Grammars, request: PrefillRequest | GenerateRequest, prompt_ids: Sequence[int]
) -> Constraint | None:
    """The request's grammar state, after the generated tokens its prompt ends with (a
    reopened session's). Thread-safe: the service prepares it in its text pool."""
    constraint = session_constraint(grammars, request.grammar)
    generated = getattr(request, "generated_tokens", 0)  # /generate's: none
    if constraint is not None and 0 < generated < len(prompt_ids):
        try:
            constraint.commit(prompt_ids[-generated:])
        except GrammarError as exc:
            raise InvalidGrammar(f"the generated tokens break the grammar: {exc}") from None
    return constraint
