"""A tool's parameters placed inside the grammar of calls: its refs point into it again,
and nothing else changes; a call the model wrote is read, and one nested past what JSON
is read to is a plain answer, not an error (the real grammar and model:
tests/integration/test_grammar.py and test_openai_api.py)."""

from __future__ import annotations

import copy

from drafter.serve.tools import CLOSE, OPEN, parse_tool_call, rebased

AT = "/anyOf/1/properties/arguments"


def test_refs_into_the_schema_point_into_it_where_it_is_placed():
    schema = {
        "$defs": {"City": {"type": "object", "properties": {"near": {"$ref": "#/$defs/City"}}}},
        "definitions": {"Old": {"type": "string"}},
        "type": "object",
        "properties": {
            "city": {"$ref": "#/$defs/City"},
            "old": {"anyOf": [{"$ref": "#/definitions/Old"}, {"type": "null"}]},
            "again": {"$ref": "#"},
            "list": {"type": "array", "items": {"$ref": "#/$defs/City"}},
            "elsewhere": {"$ref": "https://example.com/schema.json#/$defs/X"},
            "anchor": {"$ref": "#name"},
            # A property named as a keyword is a property; a const is data.
            "$ref": {"type": "string"},
            "default": {"$ref": "#/$defs/City"},
            "fixed": {"const": {"$ref": "#/$defs/City"}},
        },
        "additionalProperties": {"$ref": "#/definitions/Old"},
    }
    before = copy.deepcopy(schema)
    placed = rebased(schema, AT)
    assert schema == before  # a copy: the tool's own schema is told to the model as it is
    props = placed["properties"]
    assert placed["$defs"]["City"]["properties"]["near"]["$ref"] == f"#{AT}/$defs/City"
    assert props["city"]["$ref"] == f"#{AT}/$defs/City"
    assert props["old"]["anyOf"][0]["$ref"] == f"#{AT}/definitions/Old"
    assert props["again"]["$ref"] == f"#{AT}"
    assert props["list"]["items"]["$ref"] == f"#{AT}/$defs/City"
    assert props["default"]["$ref"] == f"#{AT}/$defs/City"
    assert placed["additionalProperties"]["$ref"] == f"#{AT}/definitions/Old"
    assert props["elsewhere"] == before["properties"]["elsewhere"]
    assert props["anchor"] == before["properties"]["anchor"]
    assert props["$ref"] == {"type": "string"}
    assert props["fixed"] == {"const": {"$ref": "#/$defs/City"}}


def test_a_schema_deeper_than_recursion_goes_is_rebased_level_by_level():
    deep: dict = {"$ref": "#"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    placed = rebased(deep, AT)
    for _ in range(5000):
        placed = placed["items"]
    assert placed == {"$ref": f"#{AT}"}


def test_a_call_is_read_and_one_nested_too_deep_is_a_plain_answer():
    call = parse_tool_call(f'{OPEN}{{"name": "f", "arguments": {{"a": [1]}}}}{CLOSE}')
    assert call is not None
    assert (call.function.name, call.function.arguments) == ("f", '{"a": [1]}')
    deep = "[" * 5000 + "]" * 5000
    assert parse_tool_call(f'{OPEN}{{"name": "f", "arguments": {deep}}}{CLOSE}') is None
