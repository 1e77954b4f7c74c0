"""A new session's decoding rules, set once at its prefill: its grammar's state (compiled
once per grammar, a copy for each session), the ids its biases name, and for a session
opened again by its client, where its prompt ends and its output begins."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from server.shared.constraint import Constraint, GrammarError, GrammarTooSlow
from server.shared.grammars import GrammarLimits, Grammars
from server.shared.protocol import GenerateRequest, Grammar, PrefillRequest, PromptInput
from server.verifier.decoding.checks import check_generated, check_prompt_len, check_token_ids
from server.verifier.errors import EmptyPrompt, InvalidGrammar


class PromptTokenizer(Protocol):
    n_vocab: int

    def tokenize(self, text: str, *, add_special: bool) -> list[int]: ...


def request_prompt_ids(runtime: PromptTokenizer, request: PromptInput, n_ctx: int) -> list[int]:
    """The prompt's token ids, checked: its text tokenized, or its ids in the vocabulary;
    not empty, and short enough for a round after it."""
    if request.prompt is not None:
        ids = runtime.tokenize(request.prompt, add_special=request.add_bos)
    else:
        ids = list(request.prompt_tokens or [])
        check_token_ids(ids, runtime.n_vocab, "prompt_tokens")
    if not ids:
        raise EmptyPrompt("the prompt is empty: give some text or add_bos=true")
    check_prompt_len(len(ids), n_ctx)
    return ids


def verifier_grammars(runtime, settings) -> Grammars:
    """The verifier's grammars, with the limits its settings give."""
    limits = GrammarLimits(
        compile_s=settings.grammar_compile_s,
        grammar_bytes=settings.grammar_max_mb * 1_000_000,
        bytes_per_owner=settings.grammar_cache_mb * 1_000_000,
        unproven_tokens=settings.grammar_unproven_tokens,
    )
    return Grammars(runtime.grammar_tokenizer, runtime.n_vocab, limits)


def session_constraint(
    grammars: Grammars, grammar: Grammar | None, owner: str = "", compile: bool = True
) -> Constraint | None:
    """The grammar's state for a new session (compiled at its first use, a copy after: the
    service compiles it off the engine thread first; without `compile`, a copy or None).
    Thread-safe."""
    if grammar is None:
        return None
    try:
        if not compile:
            return grammars.kept(grammar.kind, grammar.source, owner)
        return grammars.constraint(grammar.kind, grammar.source, owner)
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
    grammars: Grammars,
    request: PrefillRequest | GenerateRequest,
    prompt_ids: Sequence[int],
    owner: str = "",
    compile: bool = True,
    row_budget_s: float = 0.0,
) -> Constraint | None:
    """The request's grammar state, after the generated tokens its prompt ends with (a
    reopened session's, each within `row_budget_s` on average: 0, no limit); without
    `compile`, None where the grammar is not compiled already. Thread-safe: the service
    prepares it in its grammar threads."""
    constraint = session_constraint(grammars, request.grammar, owner, compile)
    generated = getattr(request, "generated_tokens", 0)  # /generate's: none
    if constraint is not None and 0 < generated < len(prompt_ids):
        try:
            constraint.commit(prompt_ids[-generated:], row_budget_s)
        except GrammarTooSlow as exc:
            raise InvalidGrammar(f"grammar: {exc}") from None
        except GrammarError as exc:
            raise InvalidGrammar(f"the generated tokens break the grammar: {exc}") from None
    return constraint
