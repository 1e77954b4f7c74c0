"""Grammars that can never end (server/shared/grammar_ends.py), found in their rules: the
and-or propagation against the plain fixed point (a symbol is productive once one of its
alternatives has only productive symbols, repeated until nothing changes), over random
Lark grammars and random JSON schemas, with parts the check does not read ("unknown" where
only they lead to an end); and the cases a client writes. The bounds on a
grammar's text and GBNF's conversion to Lark (server/shared/grammar_text.py): long
chains read within a deadline, grammars over a bound refused, the conversion
llguidance's own."""

from __future__ import annotations

import datetime
import decimal
import enum
import json
import time
import uuid
from typing import Literal, Optional, Union

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llguidance import gbnf_to_lark
from pydantic import BaseModel, HttpUrl, confloat, conint, conlist, constr

from scripts.bench_grammar_check import chained_gbnf, chained_lark_terminals
from server.shared import grammar_text
from server.shared.constraint import compile_grammar
from server.shared.grammar_ends import NEVER_ENDS, grammar_end, never_ends
from server.shared.grammar_leaves import FORMAT_TEXTS
from server.shared.grammar_text import CheckTimeout, _is_lark_syntax, grammar_bounds, lark_of_gbnf
from server.shared.json_schemas import held_schema
from tests.fixtures.byte_grammar import allows

# A random grammar: rules named r0..rn, each a list of alternatives, each a list of
# symbols: a rule's index, or None for a terminal.
SYMBOL = st.one_of(st.none(), st.integers(0, 5))
ALTERNATIVE = st.lists(SYMBOL, max_size=3)
RULES = st.lists(st.lists(ALTERNATIVE, min_size=1, max_size=3), min_size=1, max_size=6)
# The same with "u": a part the check does not read (an extension of llguidance's, a `$ref`
# to another document).
WITH_UNREAD = st.lists(
    st.lists(st.lists(st.one_of(SYMBOL, st.just("u")), max_size=3), min_size=1, max_size=3),
    min_size=1,
    max_size=6,
)
OTHER_DOCUMENT = "https://example.com/other.json"


def productive_by_fixed_point(rules, unread_productive: bool = False) -> bool:
    productive: set[int] = set()

    def holds(s) -> bool:
        return s is None or (unread_productive if s == "u" else s in productive)

    for _ in range(len(rules) + 1):
        productive |= {
            i
            for i, alternatives in enumerate(rules)
            if any(all(map(holds, a)) for a in alternatives)
        }
    return 0 in productive


def ending_by_fixed_point(rules) -> str:
    if not productive_by_fixed_point(rules, unread_productive=True):
        return "never"
    return "ends" if productive_by_fixed_point(rules) else "unknown"


def in_range(rules):
    return [
        [[s if s in (None, "u") or s < len(rules) else None for s in a] for a in r] for r in rules
    ]


def lark_text(rules) -> str:
    def symbol(s):
        return '"t"' if s is None else "unread" if s == "u" else f"r{s}"

    lines = ["start: r0"]
    if any("u" in alt for alternatives in rules for alt in alternatives):
        lines.append('unread: %json {"type": "string"}')
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
            f"p{j}": {"type": "string"}
            if s is None
            else {"$ref": OTHER_DOCUMENT if s == "u" else f"#/$defs/r{s}"}
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


@settings(max_examples=300, deadline=None)
@given(WITH_UNREAD)
def test_an_end_only_through_parts_the_check_does_not_read_is_unknown(rules):
    rules = in_range(rules)
    expected = ending_by_fixed_point(rules)
    text = lark_text(rules)
    assert grammar_end("lark", llguidance.grammar_from("lark", text)) == expected, text
    assert grammar_end("json_schema", "", schema_of(rules)) == expected, rules


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


# Issue 64: schema forms the check once missed (each wrote until the token limit).
SELF_BY_ADDITIONAL = {"type": "object", "additionalProperties": {"$ref": "#"}, "required": ["a"]}
SELF_BY_MIN_PROPERTIES = {
    "type": "object",
    "additionalProperties": {"$ref": "#"},
    "minProperties": 1,
}


def loop_at(pointer: str, key: str) -> dict:
    return {"$defs": {key: {"$ref": pointer}}, "$ref": pointer}


@pytest.mark.parametrize(
    "schema",
    [
        SELF_BY_ADDITIONAL,
        SELF_BY_MIN_PROPERTIES,
        {**SELF_BY_ADDITIONAL, "patternProperties": {"^x": {"$ref": "#"}}},
        loop_at("#/%24defs/a", "a"),
        loop_at("#/$defs/a%20b", "a b"),
        loop_at("#/$defs/a~1b", "a/b"),
        {  # a nested `$id`: its pointers read against it
            "type": "object",
            "required": ["x"],
            "properties": {
                "x": {"$id": "inner", "$defs": {"s": {"$ref": "#"}}, "$ref": "#/$defs/s"}
            },
        },
        {  # a `$ref` to a nested document by its `$id`, and to an anchor in it
            "$defs": {"n": {"$id": "https://example.com/node", "$anchor": "me", "$ref": "#me"}},
            "$ref": "https://example.com/node",
        },
        {"type": "array", "contains": {"$ref": "#"}},
    ],
)
def test_schemas_that_can_never_end_by_every_way_of_naming_themselves(schema):
    assert never_ends("json_schema", "", schema) == NEVER_ENDS


class Tree(BaseModel):
    value: int
    children: list[Tree] = []
    parent: Optional[Tree] = None  # noqa: UP045 (the shape pydantic users write)
    labels: dict[str, Tree] = {}
    either: Union[int, str, None] = None  # noqa: UP007


@pytest.mark.parametrize(
    "schema",
    [
        Tree.model_json_schema(),
        held_schema(Tree.model_json_schema()),
        {"type": "object", "additionalProperties": {"type": "string"}, "required": ["a"]},
        {"type": "object", "additionalProperties": {"$ref": "#"}, "minProperties": 0},
        {"type": "object", "properties": {"a": {"type": "null"}}, "minProperties": 1},
        {"type": "array", "contains": {"type": "string"}, "minContains": 0, "items": {"$ref": "#"}},
        {"$defs": {"a b": {"type": "string"}}, "$ref": "#/$defs/a%20b"},
        {  # the same `$id` twice: which one a `$ref` means is llguidance's to say
            "$defs": {"a": {"$id": "x", "$ref": "x"}, "b": {"$id": "x", "type": "string"}},
            "$ref": "x",
        },
    ],
)
def test_everyday_schemas_and_ones_that_end_some_way_pass(schema):
    assert never_ends("json_schema", "", schema) is None


@pytest.mark.parametrize(
    "text",
    [
        'start: "a" start\nunused: %json {"type": "object"}',  # an unread rule, unused
        'start: x\nx: "a" x\ny[max_tokens=3]: "b"',
        'start: "a" start\n%ignore " "',
    ],
)
def test_a_lark_rule_the_check_does_not_read_leaves_the_rest_checked(text):
    assert never_ends("lark", llguidance.grammar_from("lark", text)) == NEVER_ENDS


@pytest.mark.parametrize(
    "text",
    [
        'start: x\nx: "a" x | y\ny: %json {"type": "object"}',  # an end through it: unread
        'start: x\nx[max_tokens=3]: "a" x',
        'start: "a" start\n// a comment between\n  | "b"',
        'start: "a" start\n\n\n  | "b"',
    ],
)
def test_an_end_through_a_rule_the_check_does_not_read_passes(text):
    assert never_ends("lark", llguidance.grammar_from("lark", text)) is None


def test_long_chains_are_read_within_a_deadline_checked_as_the_check_walks():
    for kind, text in (("gbnf", chained_gbnf(1600)), ("lark", chained_lark_terminals(1800))):
        assert grammar_bounds(kind, text) is None
        grammar = compile_grammar(kind, text)
        assert never_ends(kind, grammar) is None
        with pytest.raises(CheckTimeout):
            never_ends(kind, grammar, deadline=time.perf_counter() - 1)
    schema = {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(900)}}
    schema["$defs"]["d900"] = {"$ref": "#/$defs/d0"}
    with pytest.raises(CheckTimeout):
        never_ends("json_schema", "", {**schema, "$ref": "#/$defs/d0"}, time.perf_counter() - 1)


@pytest.mark.parametrize(
    "kind,text,limit",
    [
        ("gbnf", chained_gbnf(2100), "MAX_WEIGHT"),
        ("lark", chained_lark_terminals(2100), "MAX_WEIGHT"),
        ("lark", "start: " + "(" * 40 + '"a"' + ")" * 40, "MAX_DEPTH"),
        ("gbnf", "root ::= " + "(" * 40 + '"a"' + ")" * 40, "MAX_DEPTH"),
        (  # nesting counts toward the weight: llguidance recurses through both
            "lark",
            "\n".join(
                ["start: r0"]
                + [f"r{i}: " + "(" * 9 + f'"a" r{i + 1} | "b"' + ")" * 9 for i in range(300)]
            ),
            "MAX_WEIGHT",
        ),
    ],
)
def test_grammars_over_a_bound_are_refused_before_they_are_read(kind, text, limit):
    reason = grammar_bounds(kind, text)
    assert reason is not None and f"limit of {getattr(grammar_text, limit)}" in reason


def test_parentheses_in_literals_and_classes_are_not_nesting():
    gbnf = "root ::= " + " ".join(['"(("', "[(]", '"\\"("'] * 50) + "  # (((\n"
    lark = "start: " + " ".join(['"(("', "/[(]/", '"\\"("'] * 50) + "  // (((\n"
    assert grammar_bounds("gbnf", gbnf) is None and grammar_bounds("lark", lark) is None


GBNF_SAMPLES = [
    'root ::= "a" root | [0-9]+',
    'root ::= item ("," item)*\nitem ::= [a-z]+ | "(" root ")"\n',
    'root ::= x\nx ::= y y\ny ::= z | "q"\nz ::= "a"{2,3}\n# a comment\n',
    'root   ::= object\nobject ::= "{" ws ( string ":" ws value ("," ws string ":" value)* )? "}"\n'
    'value  ::= object | string | "null"\nstring ::= "\\"" [^"]* "\\""\nws ::= [ \\t\\n]*',
    'root ::= fooBar-baz\nfooBar-baz ::= "x" root | "y"',
    chained_gbnf(60),
]


@pytest.mark.parametrize("text", GBNF_SAMPLES)
def test_the_gbnf_conversion_is_llguidances(text):
    assert lark_of_gbnf(text) == gbnf_to_lark.gbnf_to_lark(text)


@settings(max_examples=200, deadline=None)
@given(RULES)
def test_the_gbnf_conversion_is_llguidances_for_random_rules(rules):
    rules = [[[s if s is None or s < len(rules) else None for s in a] for a in r] for r in rules]
    text = lark_text(rules).replace("start:", "root ::=").replace(": ", " ::= ")
    assert lark_of_gbnf(text) == gbnf_to_lark.gbnf_to_lark(text)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["\n", " ", "\t", "start", ":", "%llguidance", "x"])).map("".join))
def test_whether_a_text_is_lark_is_llguidances_answer(text):
    assert _is_lark_syntax(text) == gbnf_to_lark.is_lark_syntax(text)


@pytest.mark.parametrize(
    "kind,source",
    [
        ("lark", 'start: %json {"type": "object"}'),  # start itself not read
        ("lark", 'start: x\nx: "a" x | y\ny: %json {"type": "object"}'),
        ("lark", 'start: x\nx[max_tokens=3]: "a" x'),
        ("lark", "start: a\n%import common.word -> a"),  # a rule of the server's files
        ("lark", 'start: t{"a"}\nt{x}: x t{x} | x'),  # a template's use
        ("json_schema", {"$ref": OTHER_DOCUMENT}),
        (
            "json_schema",
            {"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#/$defs/missing"}}},
        ),
        ("json_schema", {"$ref": "#nowhere"}),  # an anchor the schema does not have
        (
            "json_schema",
            {  # the same `$id` twice: which one a `$ref` means is llguidance's
                "$defs": {"a": {"$id": "x", "$ref": "x"}, "b": {"$id": "x", "type": "string"}},
                "$ref": "x",
            },
        ),
    ],
)
def test_grammars_whose_end_the_check_cannot_prove(kind, source):
    grammar = source if kind == "json_schema" else llguidance.grammar_from(kind, source)
    assert grammar_end(kind, grammar, source) == "unknown"


@pytest.mark.parametrize(
    "kind,source",
    [
        ("lark", 'start: "a" start | "b"'),
        ("lark", "%import common.WORD\nstart: WORD"),  # a terminal: whatever it is, it ends
        ("lark", 'start: "a" start | "b"\nunused: %json {"type": "object"}'),
        ("gbnf", 'root ::= "a" x\nx ::= "b" x | ""'),
        ("gbnf", chained_gbnf(200)),
        ("regex", "(ab)+"),
        ("json_schema", True),
        ("json_schema", LINKED),
        ("json_schema", {"anyOf": [{"$ref": OTHER_DOCUMENT}, {"type": "null"}]}),
    ],
)
def test_grammars_the_check_proves_can_end(kind, source):
    grammar = source if kind in ("json_schema", "regex") else llguidance.grammar_from(kind, source)
    assert grammar_end(kind, grammar, source) == "ends"


# Review of issue 64: leaves that match nothing are no way to end (grammar_leaves.py).
def recursive_schema(way_out: dict) -> dict:
    """An object whose one required key is itself or `way_out`: it ends only through it."""
    return {
        "type": "object",
        "properties": {"a": {"anyOf": [{"$ref": "#"}, way_out]}},
        "required": ["a"],
    }


NOTHING = r"[^\s\S]"


@pytest.mark.parametrize(
    "kind,source,ending",
    [
        ("lark", f'start: "a" start | E\nE: /{NOTHING}/', "never"),
        ("lark", f'start: "a" start | /{NOTHING}/', "never"),
        ("lark", 'start: "a" start | E\nE: "b" /[^\\x00-\\U0010ffff]/+', "never"),
        ("lark", 'start: "a" start | E\nE: F | "b" F\nF: /[^\\d\\D]/', "never"),
        ("lark", f'start: "a" start | E\nE: /b/ /{NOTHING}/?', "ends"),  # an optional nothing
        ("lark", 'start: "a" start | E\nE: /b/ & /c/', "unknown"),  # llguidance's `&`
        ("lark", 'start: "a" start | E\nE: ~/b/', "unknown"),  # and its `~`
        ("lark", 'start: "a" start | E\nE: /(?=b)c/', "unknown"),  # a lookaround
        ("lark", 'start: "a" start | E\nE: /[\\p{L}--a]/', "unknown"),  # Rust's set syntax
        ("lark", 'start: "a" start | E\nE: /\\p{L}+/ | "x"', "ends"),
        ("lark", 'start: "a" start | E\nE: /\\p{L}+/', "ends"),
        ("lark", 'start: "a" start | E\nE: /[a-z_][a-z0-9_]*/i', "ends"),
        ("lark", 'start: "a" start | E\nE: /"(\\\\.|[^"\\\\])*"/', "ends"),
        ("lark", 'start: "a" start | E\nE: "0".."9"+', "ends"),
        ("lark", 'start: "a" start | E\nE.2: /[^a]/', "ends"),
        ("regex", "[0-9]+(\\.[0-9]+)?", "ends"),
    ],
)
def test_a_terminal_that_matches_nothing_is_no_way_to_end(kind, source, ending):
    grammar = source if kind == "regex" else llguidance.grammar_from(kind, source)
    assert grammar_end(kind, grammar) == ending


@pytest.mark.parametrize(
    "way_out",
    [
        {"type": "integer", "minimum": 5, "maximum": 3},
        {"type": "integer", "minimum": 1.5, "maximum": 1.7},  # no integer between
        {"type": "integer", "minimum": 1, "maximum": 9, "multipleOf": 10},
        {"type": "number", "exclusiveMinimum": 3, "exclusiveMaximum": 3},
        {"type": "number", "minimum": 3, "exclusiveMaximum": 3},
        {"type": "number", "minimum": 0.05, "maximum": 0.07, "multipleOf": 0.1},
        {"type": "string", "minLength": 5, "maxLength": 2},
        {"type": "string", "pattern": NOTHING},
        {"type": "array", "minItems": 3, "maxItems": 1},
        {"type": "object", "minProperties": 2, "maxProperties": 1},
        {"type": "integer", "enum": ["a", "b"]},
        {"type": "string", "const": 3},
        {"enum": []},
        {"type": ["integer", "string"], "minimum": 5, "maximum": 3, "minLength": 2, "maxLength": 1},
    ],
)
def test_a_schema_whose_only_way_out_is_a_leaf_that_matches_nothing_never_ends(way_out):
    assert grammar_end("json_schema", "", recursive_schema(way_out)) == "never"


@pytest.mark.parametrize(
    "way_out",
    [
        {"type": "string", "pattern": "^(?=a)b"},  # a lookaround: not read
        {"type": "string", "pattern": "[a-z]{5}", "maxLength": 3},  # a pattern beside lengths
        {"type": "string", "format": "email", "maxLength": 3},
        {"type": "string", "format": "date", "pattern": "x"},
        {"type": "integer", "const": 3, "minimum": 5},  # a value out of its own bounds
        {"type": "string", "pattern": "[[:alpha:]]"},  # Rust's, read otherwise by Python
    ],
)
def test_a_schema_whose_only_way_out_is_a_leaf_the_check_cannot_judge_is_unknown(way_out):
    assert grammar_end("json_schema", "", recursive_schema(way_out)) == "unknown"


@pytest.mark.parametrize(
    "way_out",
    [
        {"type": "integer", "minimum": 3, "maximum": 3},
        {"type": "integer", "exclusiveMinimum": 1.5, "exclusiveMaximum": 2.5},
        {"type": "number", "exclusiveMinimum": 3, "exclusiveMaximum": 3.001},
        {"type": "number", "minimum": 0.05, "maximum": 0.1, "multipleOf": 0.1},
        {"type": "string", "minLength": 2, "maxLength": 2},
        {"type": "string", "pattern": "^[a-z]{3}-\\d+$", "minLength": 5, "maxLength": 9},
        {"type": "string", "pattern": "\\p{Lu}\\w*"},
        {"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083},
        {"type": "string", "format": "date-time"},
        {"type": "array", "minItems": 1, "maxItems": 1},
        {"type": "boolean"},
        {"type": "null"},
        {"type": ["integer", "null"], "minimum": 5, "maximum": 3},
        {"type": "integer", "enum": ["a", 2]},
        {"const": {"any": "value"}},
    ],
)
def test_a_schema_whose_only_way_out_is_a_leaf_that_matches_something_ends(way_out):
    assert grammar_end("json_schema", "", recursive_schema(way_out)) == "ends"


class Colour(enum.Enum):
    RED = "red"
    GREEN = "green"


class Address(BaseModel):
    street: constr(min_length=1, max_length=80)  # type: ignore[valid-type]
    postcode: constr(pattern=r"^\d{5}(-\d{4})?$")  # type: ignore[valid-type]


class Order(BaseModel):
    id: uuid.UUID
    placed: datetime.datetime
    due: datetime.date
    quantity: conint(ge=1, le=100)  # type: ignore[valid-type]
    price: confloat(gt=0)  # type: ignore[valid-type]
    total: decimal.Decimal
    colour: Colour
    kind: Literal["retail", "wholesale"]
    site: HttpUrl
    address: Address
    lines: conlist(str, min_length=1, max_length=5)  # type: ignore[valid-type]
    notes: Optional[str] = None  # noqa: UP045
    refers_to: Optional[Order] = None  # noqa: UP045


@pytest.mark.parametrize(
    "schema", [Order.model_json_schema(), held_schema(Order.model_json_schema())]
)
def test_everyday_pydantic_leaves_end(schema):
    assert grammar_end("json_schema", "", schema) == "ends"


@pytest.mark.parametrize("name,text", sorted(FORMAT_TEXTS.items()))
def test_each_format_read_is_llguidances_and_its_text_one_it_accepts(name, text):
    grammar = compile_grammar("json_schema", {"type": "string", "format": name})
    assert allows(grammar, json.dumps(text))
