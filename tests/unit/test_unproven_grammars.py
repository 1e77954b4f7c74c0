"""A grammar whose end the check cannot prove (server/shared/grammar_ends.py, issue 64) is
accepted and bounded: its sessions generate at most VERIFIER_GRAMMAR_UNPROVEN_TOKENS, the
tokens of a reopened session's prompt counted, and a round that could pass the bound is
refused (400 grammar_token_limit); a grammar proven to end has no bound but the context.
With a tokenizer of one token a byte: no model."""

from __future__ import annotations

import pytest

from server.shared.constraint import TokenLimitReached
from server.shared.grammars import GrammarLimits, Grammars
from server.shared.protocol import PrefillRequest
from server.verifier.decoding.decoding_rules import prepared_constraint
from server.verifier.decoding.rounds import grammar_step
from server.verifier.errors import GrammarTokenLimit
from tests.fixtures.byte_grammar import END, TOKENIZER

# Its only end is through a rule the check does not read (llguidance's `%json`).
UNPROVEN = 'start: "a" start | tail\ntail: %json {"type": "string"}'
PROVEN = 'start: "a" start | "b"'


def grammars(unproven_tokens: int) -> Grammars:
    return Grammars(lambda: TOKENIZER, END + 1, GrammarLimits(unproven_tokens=unproven_tokens))


def test_a_grammar_whose_end_is_unproven_carries_the_bound_and_a_proven_one_none():
    shelf = grammars(5)
    assert shelf.constraint("lark", UNPROVEN, "k").token_limit == 5
    assert shelf.kept("lark", UNPROVEN, "k").token_limit == 5  # a copy, bounded alike
    assert shelf.constraint("lark", PROVEN, "k").token_limit is None
    assert grammars(0).constraint("lark", UNPROVEN, "k").token_limit is None  # 0: unbounded


def test_rounds_stop_at_the_bound_and_an_undone_commit_gives_its_tokens_back():
    state = grammars(5).constraint("lark", UNPROVEN)
    a = ord("a")
    state.row_masks([a, a, a, a])  # 5 tokens at most: fits
    with pytest.raises(TokenLimitReached, match="VERIFIER_GRAMMAR_UNPROVEN_TOKENS"):
        state.row_masks([a] * 5)
    state.commit([a, a])
    undo = state.commit([a])
    assert state.generated == 3
    state.row_masks([a])  # to 5
    with pytest.raises(TokenLimitReached):
        state.row_masks([a, a])
    undo()
    state.row_masks([a, a])
    state.defer([a, a, a])  # a round's committed tokens count once the next masks take them
    with pytest.raises(TokenLimitReached):
        state.row_masks([])
    assert state.generated == 5 and state.failure is None  # a bound, not a failed grammar


def test_the_bound_is_a_400_of_its_own_and_counts_a_reopened_sessions_tokens():
    shelf, a = grammars(4), ord("a")
    request = PrefillRequest(
        prompt_tokens=[1, a, a, a],
        generated_tokens=3,
        grammar={"kind": "lark", "source": UNPROVEN},
    )
    state = prepared_constraint(shelf, request, request.prompt_tokens)
    assert state is not None and state.generated == 3
    state.row_masks([])  # the fourth
    with pytest.raises(GrammarTokenLimit) as refused:
        grammar_step(lambda: state.row_masks([a]))
    assert refused.value.status_code == 400
    assert refused.value.error_type == "grammar_token_limit"
