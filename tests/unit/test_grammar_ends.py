"""Grammars that can never end (server/shared/grammar_ends.py), found in their rules: the
and-or propagation against the plain fixed point (a symbol is productive once one of its
alternatives has only productive symbols, repeated until nothing changes), over random
Lark grammars and random JSON schemas; and the cases a client writes."""

from __future__ import annotations

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.shared.grammar_ends import NEVER_ENDS, never_ends

# A random grammar: rules named r0..rn, each a list of alternatives, each a list of
# symbols: a rule's index, or None for a terminal.
SYMBOL = st.one_of(st.none(), st.integers(0, 5))
ALTERNATIVE = st.lists(SYMBOL, max_size=3)
RULES = st.lists(st.lists(ALTERNATIVE, min_size=1, max_size=3), min_size=1, max_size=6)


def productive_by_fixed_point(rules: list[list[list[int | None]]]) -> bool:
    productive: set[int] = set()
    for _ in range(len(rules) + 1):
        productive |= {
            i
            for i, alternatives in enumerate(rules)
            if any(all(s is None or s in productive for s in alt) for alt in alternatives)
        }
    return 0 in productive


def lark_text(rules) -> str:
    def symbol(s):
        return '"t"' if s is None else f"r{s}" if s < len(rules) else '"u"'

    lines = ["start: r0"]
    for i, alternatives in enumerate(rules):
        expansions = [" ".join(symbol(s) for s in alt) or '""' for alt in alternatives]
        lines.append(f"r{i}: " + " | ".join(expansions))
    return "\n".join(lines)


@settings(max_examples=300, deadline=None)
@given(RULES)
def test_a_lark_grammar_never_ends_exactly_when_its_start_is_unproductive(rules):
    rules = [[[s if s is None or s < len(rules) else None for s in a] for a in r] for r in rules]
    text = lark_text(rules)
    found = never_ends("lark", llguidance.grammar_from("lark", text))
    assert (found is None) == productive_by_fixed_point(rules), text


def schema_of(rules) -> dict:
    """The same rules as a JSON schema: a rule is an `anyOf` of its alternatives, an
    alternative an object whose properties, each required, are its symbols (a string where
    the symbol is a terminal)."""

    def alternative(symbols):
        properties = {
            f"p{j}": {"type": "string"} if s is None else {"$ref": f"#/$defs/r{s}"}
            for j, s in enumerate(symbols)
        }
        return {"type": "object", "properties": properties, "required": list(properties)}

    defs = {f"r{i}": {"anyOf": [alternative(a) for a in r]} for i, r in enumerate(rules)}
    return {"$defs": defs, "$ref": "#/$defs/r0"}


@settings(max_examples=300, deadline=None)
@given(RULES)
def test_a_schema_never_ends_exactly_when_its_root_is_unproductive(rules):
    rules = [[[s if s is None or s < len(rules) else None for s in a] for a in r] for r in rules]
    found = never_ends("json_schema", "", schema_of(rules))
    assert (found is None) == productive_by_fixed_point(rules), rules


@pytest.mark.parametrize(
    "kind,source",
    [
        ("lark", 'start: "a" start'),
        ("lark", "start: a\na: b\nb: a"),
        ("gbnf", 'root ::= "a" root'),
        ("json_schema", {"$ref": "#"}),
        ("json_schema", {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
        ("json_schema", {"type": "array", "items": {"$ref": "#"}, "minItems": 1}),
        ("json_schema", {"$defs": {"A": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}),
        ("lark", 'start: x\nx: "" x'),
        ("lark", 'start: x\nx: "a" x+'),
        ("lark", 'start: x\nx: ("a" x) ~ 2'),
        ("lark", 'start: x\nx: "a" x -> named\n  | "b" x'),
    ],
)
def test_grammars_that_can_never_end(kind, source):
    grammar = source if kind == "json_schema" else llguidance.grammar_from(kind, source)
    assert never_ends(kind, grammar, source) == NEVER_ENDS


# A linked list as pydantic writes it: `next` may be null, so it ends.
LINKED = {
    "$defs": {
        "Node": {
            "type": "object",
            "properties": {"next": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}},
            "required": ["next"],
        }
    },
    "$ref": "#/$defs/Node",
}


@pytest.mark.parametrize(
    "kind,source",
    [
        ("lark", 'start: "a" start | "b"'),
        ("lark", 'start: x\nx: x x | x x x | "a"'),
        ("lark", 'start: %json {"type": "object"}'),  # llguidance's own syntax: not read
        ("gbnf", 'root ::= "a" root | [0-9]+'),
        ("gbnf", 'root ::= "a" x\nx ::= "b" x | ""'),
        ("lark", "start: " + " ".join(['"a"?'] * 40)),  # 2^40 expansions, were they compiled
        ("lark", 'start: ("a" ~ 10..20 "b"?) ~ 10..20'),
        ("lark", 'start: x\nx: "a" [x] | "a" x?'),
        ("lark", "%import common.WORD\nstart: WORD"),  # a file of the server's: never read
        ("gbnf", 'root ::= "a" x\nx ::= "b" x | ""'),
        ("regex", "(ab)+"),
        ("json_schema", LINKED),
        ("json_schema", {"type": "object", "properties": {"a": {"$ref": "#"}}}),
        ("json_schema", {"properties": {"a": {"$ref": "#"}}, "required": ["a"]}),  # any type
        (
            "json_schema",
            {"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#"}], "minItems": 1},
        ),
        ("json_schema", {"$ref": "https://example.com/schema"}),  # not the check's to resolve
        ("json_schema", {"type": "object", "required": [["odd"]]}),
        # An anchor, and a pointer under a nested `$id`: not resolved against the root.
        (
            "json_schema",
            {
                "$defs": {"s": {"$anchor": "a", "type": "string"}},
                "type": "object",
                "properties": {"x": {"$ref": "#a"}},
                "required": ["x"],
            },
        ),
        (
            "json_schema",
            {
                "type": "object",
                "required": ["x"],
                "properties": {
                    "x": {"$id": "inner", "$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s"}
                },
            },
        ),
    ],
)
def test_grammars_that_can_end_or_that_the_check_cannot_read_pass(kind, source):
    grammar = source if kind in ("json_schema", "regex") else llguidance.grammar_from(kind, source)
    assert never_ends(kind, grammar, source) is None
