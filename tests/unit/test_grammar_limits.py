"""A grammar's limits while it is read (server/shared/constraint.py, issue 64): a grammar
over a bound of its size is refused before any of it is read, and remembered; the compile
limit stops GBNF's conversion and the "can never end" check where they are, before
llguidance compiles anything; another key's grammar is compiled as before. With a
tokenizer of one token a byte: no model."""

from __future__ import annotations

import pytest

from scripts.bench_grammar_check import chained_gbnf, chained_lark_terminals
from server.shared import constraint as constraint_module
from server.shared.constraint import GrammarError
from server.shared.grammar_text import MAX_WEIGHT
from server.shared.grammars import GrammarLimits, Grammars
from tests.fixtures.byte_grammar import END, TOKENIZER


def grammars(**limits) -> Grammars:
    return Grammars(lambda: TOKENIZER, END + 1, GrammarLimits(**limits))


@pytest.fixture
def compiles(monkeypatch) -> list[str]:
    """What reached llguidance's compiler."""
    built: list[str] = []
    real = constraint_module.llguidance.LLMatcher

    def matcher(tokenizer, grammar, **options):
        built.append(grammar)
        return real(tokenizer, grammar, **options)

    monkeypatch.setattr(constraint_module.llguidance, "LLMatcher", matcher)
    return built


def test_a_grammar_over_its_weight_is_refused_unread_and_remembered(compiles, monkeypatch):
    shelf = grammars(compile_s=60)
    read: list[str] = []
    monkeypatch.setattr(constraint_module, "lark_of_gbnf", lambda text, *_: read.append(text))
    for _ in range(2):
        with pytest.raises(GrammarError, match=f"limit of {MAX_WEIGHT}"):
            shelf.constraint("gbnf", chained_gbnf(MAX_WEIGHT + 10), owner="mallory")
    assert read == [] and compiles == []


@pytest.mark.parametrize(
    "kind,text", [("gbnf", chained_gbnf(1600)), ("lark", chained_lark_terminals(1800))]
)
def test_the_compile_limit_stops_the_read_before_llguidance_compiles(compiles, kind, text):
    shelf = grammars(compile_s=1e-9)
    for _ in range(2):  # the second refused at once, as refused for a limit
        with pytest.raises(GrammarError, match="VERIFIER_GRAMMAR_COMPILE_S"):
            shelf.constraint(kind, text, owner="mallory")
    assert compiles == []


def test_long_chains_within_the_bounds_compile_beside_another_keys_grammar(compiles):
    shelf = grammars(compile_s=60)
    shelf.constraint("gbnf", chained_gbnf(1600), owner="mallory")
    shelf.constraint("lark", chained_lark_terminals(1800), owner="mallory")
    shelf.constraint("json_schema", {"type": "object"}, owner="alice")
    assert len(compiles) == 3
    with pytest.raises(GrammarError, match="can never end"):
        shelf.constraint("lark", 'start: "a" start\nunused: %json {"type": "object"}')
