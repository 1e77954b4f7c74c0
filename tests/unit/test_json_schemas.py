"""A JSON schema as the grammar holds it, as llama.cpp, xgrammar and outlines hold one:
objects closed unless the schema opens them, whitespace bounded, a client's own
`x-guidance` respected; and the compiled grammar refuses what the schema no longer allows
(a byte tokenizer: tests/fixtures/byte_grammar.py)."""

from __future__ import annotations

import copy
import json

from server.shared.constraint import compile_grammar
from server.shared.grammar_ends import NEVER_ENDS, never_ends
from server.shared.json_schemas import GUIDANCE, WHITESPACE, held_schema
from tests.fixtures.byte_grammar import allows

CITY = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
# A pydantic model's own schema: no additionalProperties anywhere.
PERSON = {
    "$defs": {"City": CITY},
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "home": {"anyOf": [{"$ref": "#/$defs/City"}, {"type": "null"}]},
        "tags": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "required": ["name", "age"],
}


def test_objects_are_closed_unless_the_schema_opens_them():
    before = copy.deepcopy(PERSON)
    held = held_schema(PERSON)
    assert before == PERSON  # a copy
    assert held["additionalProperties"] is False
    assert held["$defs"]["City"]["additionalProperties"] is False
    assert held["properties"]["tags"]["additionalProperties"] == {"type": "string"}  # a map
    assert held[GUIDANCE] == {"whitespace_pattern": WHITESPACE}
    assert held_schema({"type": "object"}) == {"type": "object", GUIDANCE: held[GUIDANCE]}
    opened = {"properties": {"a": {}}, "unevaluatedProperties": True}
    assert "additionalProperties" not in held_schema(opened)
    # A required key beyond the properties: closed, it could never be written.
    beyond = {"properties": {"a": {}}, "required": ["a", "b"]}
    assert "additionalProperties" not in held_schema(beyond)
    # Data is not a schema: a const or a default keeps its keys.
    data = {"properties": {"a": {"const": {"properties": {}}, "default": {"properties": {}}}}}
    assert held_schema(data)["properties"]["a"] == data["properties"]["a"]
    assert held_schema(True) is True


def test_the_parts_of_an_intersection_stay_open():
    a = {"properties": {"a": {"type": "integer"}}, "required": ["a"]}
    b = {"properties": {"b": {"type": "integer"}}, "required": ["b"]}
    schema = {
        "$defs": {"A": a, "Lone": copy.deepcopy(a)},
        "properties": {
            "both": {"allOf": [{"$ref": "#/$defs/A"}, b]},
            "lone": {"allOf": [{"$ref": "#/$defs/Lone"}], "description": "one part only"},
            "more": {"$ref": "#/$defs/A", "properties": {"c": {"type": "integer"}}},
        },
    }
    held = held_schema(schema)
    both = held["properties"]["both"]
    assert "additionalProperties" not in held["$defs"]["A"]
    assert "additionalProperties" not in both and "additionalProperties" not in both["allOf"][1]
    assert "additionalProperties" not in held["properties"]["more"]
    assert held["$defs"]["Lone"]["additionalProperties"] is False  # all there is of it
    grammar = compile_grammar("json_schema", held["properties"]["both"] | {"$defs": held["$defs"]})
    assert allows(grammar, '{"a": 1, "b": 2}')


def test_a_clients_own_whitespace_options_are_kept():
    compact = held_schema({"type": "object", GUIDANCE: {"whitespace_flexible": False}})
    assert compact[GUIDANCE] == {"whitespace_flexible": False}
    lenient = held_schema({"type": "object", GUIDANCE: {"lenient": True}})
    assert lenient[GUIDANCE] == {"lenient": True, "whitespace_pattern": WHITESPACE}
    grammar = compile_grammar(
        "json_schema", {"type": "object", GUIDANCE: {"whitespace_flexible": False}}
    )
    assert allows(grammar, '{"a":1}') and not allows(grammar, '{"a": 1}')


def test_the_compiled_grammar_writes_no_invented_keys_and_bounded_whitespace():
    grammar = compile_grammar("json_schema", PERSON)
    assert allows(grammar, '{"name": "Mara", "age": 25}')
    assert allows(grammar, '{\n  "name": "Mara",\n  "age": 25,\n  "home": {"name": "Oslo"}\n}')
    assert not allows(grammar, '{"name": "Mara", "age": 25, "name_2"', whole=False)
    assert not allows(grammar, '{"name": "Mara", "age": 25, "home": {"name": "O", "x"', False)
    assert not allows(grammar, '{"name":   "Mara"', whole=False)
    assert not allows(grammar, '{\n\n\n"name"', whole=False)
    # The same schema as text compiles the same.
    assert compile_grammar("json_schema", json.dumps(PERSON)) == grammar


def test_a_schema_deeper_than_recursion_goes_is_held_level_by_level():
    deep: dict = {"properties": {"leaf": {"type": "integer"}}}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    held = held_schema(deep)
    for _ in range(5000):
        held = held["items"]
    assert held["additionalProperties"] is False


def test_closing_keeps_what_the_never_ends_check_reads():
    loop = {"type": "object", "properties": {"again": {"$ref": "#"}}, "required": ["again"]}
    assert never_ends("json_schema", "", held_schema(loop)) == NEVER_ENDS
    assert never_ends("json_schema", "", held_schema(PERSON)) is None


def test_alternatives_beside_keys_of_their_own_stay_open():
    """A tagged union: the object lists its tag and requires it, and each alternative adds
    its own keys (repeating the tag or not). Closed, either side would refuse the other's
    keys and no object could be written; left open, both validate as the schema says."""
    tagged = {
        "type": "object",
        "properties": {"kind": {"type": "string"}},
        "required": ["kind"],
        "anyOf": [{"properties": {"x": {"type": "integer"}}, "required": ["x"]}],
    }
    one_of_refs = {
        "type": "object",
        "properties": {"kind": {"type": "string"}},
        "required": ["kind"],
        "oneOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}],
        "$defs": {
            "a": {"properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}},
            "b": {"properties": {"kind": {"const": "b"}, "y": {"type": "integer"}}},
        },
    }
    held = held_schema(tagged)
    assert "additionalProperties" not in held and "additionalProperties" not in held["anyOf"][0]
    assert allows(compile_grammar("json_schema", tagged), '{"kind": "p", "x": 1}')
    held = held_schema(one_of_refs)
    assert all("additionalProperties" not in d for d in held["$defs"].values())
    assert allows(compile_grammar("json_schema", one_of_refs), '{"kind": "a", "x": 1}')
    # A union of whole objects, beside no keys of its own, closes each.
    union = {"anyOf": [{"type": "object", "properties": {"x": {"type": "integer"}}}]}
    assert held_schema(union)["anyOf"][0]["additionalProperties"] is False
