"""A tool's parameters placed inside the grammar of calls: its refs point into it again,
and nothing else changes; a call the model wrote is read, and one nested past what JSON
is read to is dropped, not an error; the grammar of calls (text or calls, several
where allowed, arguments closed) and calls read back whole and from a stream (the real
grammar and model: tests/integration/test_grammar.py and test_openai_api.py)."""

from __future__ import annotations

import copy
import json

from drafter.serve.backend import Finished
from drafter.serve.chat_api import ChatCompletionRequest
from drafter.serve.chat_writer import Answered, Reply
from drafter.serve.messages_writer import MessagesWriter
from drafter.serve.responses_api import ResponsesRequest
from drafter.serve.responses_writer import ResponsesWriter
from drafter.serve.tools import CLOSE, OPEN, CallSniffer, parse_tool_calls, rebased, tool_grammar
from server.shared.constraint import compile_grammar
from tests.fixtures.byte_grammar import allows

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


def test_a_call_is_read_and_one_nested_too_deep_is_dropped_not_an_error():
    _, (call,) = parse_tool_calls(f'{OPEN}{{"name": "f", "arguments": {{"a": [1]}}}}{CLOSE}')
    assert (call.function.name, call.function.arguments) == ("f", '{"a": [1]}')
    deep = f'{OPEN}{{"name": "f", "arguments": {"[" * 5000 + "]" * 5000}}}{CLOSE}'
    assert parse_tool_calls(deep) == ("", [])


# --- the grammar of calls, and calls read back (a byte tokenizer: no model) ---

PARAMETERS = {  # a pydantic model's own schema: no additionalProperties
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
PARIS = f'{OPEN}{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}{CLOSE}'
ROME = f'{OPEN}{{"name": "get_weather", "arguments": {{"city": "Rome"}}}}{CLOSE}'


def grammar(tool_choice="auto", parallel: bool | None = None) -> str:
    body = {
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [
            {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
        ],
        "tool_choice": tool_choice,
    }
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    tools = tool_grammar(ChatCompletionRequest.model_validate(body))
    return compile_grammar(tools.kind, tools.source)


def test_auto_is_a_text_without_call_markup_or_calls_after_a_text():
    auto = grammar()
    for text in ["It is sunny.", "<b>sunny</b>", PARIS, f"\n{PARIS}", f"Let me look.\n{PARIS}"]:
        assert allows(auto, text), text
    assert allows(auto, f"{PARIS}\n{ROME}")  # parallel calls: OpenAI's default
    assert not allows(grammar(parallel=False), f"{PARIS}\n{ROME}")
    assert allows(grammar(parallel=False), PARIS)
    # The markup is a call or nothing: never text after it, never text with it inside.
    assert not allows(auto, f"{PARIS} and more")
    assert not allows(auto, "a <tool_call>x", whole=False)
    # Arguments are closed as a response format's schema is, whitespace bounded.
    assert not allows(auto, f'{OPEN}{{"name": "get_weather", "arguments": {{"city": "P", "x', False)
    assert not allows(auto, f'{OPEN}{{"name":    "get_weather"', whole=False)


def test_required_and_named_are_calls_only():
    for choice in ["required", {"type": "function", "function": {"name": "get_weather"}}]:
        forced = grammar(choice)
        assert allows(forced, PARIS) and allows(forced, f"{PARIS}\n{ROME}")
        assert not allows(forced, "It is sunny.", whole=False)
        assert not allows(grammar(choice, parallel=False), f"{PARIS}\n{ROME}")


def test_calls_are_read_after_a_text_each_with_its_own_id():
    text, calls = parse_tool_calls(f"Let me look.\n{PARIS}\n{ROME}")
    assert text == "Let me look."
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    assert calls[0].id != calls[1].id
    assert parse_tool_calls("It is sunny.") == ("It is sunny.", [])
    cut = f"{PARIS}\n{ROME[:30]}"  # the token limit cut the second call
    assert [c.function.name for c in parse_tool_calls(cut)[1]] == ["get_weather"]
    assert parse_tool_calls(f"Look.\n{ROME[:30]}") == ("Look.", [])  # never as text


def test_a_stream_lets_text_through_and_holds_the_calls():
    sniffer = CallSniffer()
    pieces = ["Let", " me look.", "\n<tool", "_call>\n{", PARIS[len(OPEN) + 1 :], "\n", ROME]
    shown = "".join(sniffer.feed(piece) for piece in pieces)
    held, calls = sniffer.finish()
    assert (shown, held) == ("Let me look.", "")
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    plain = CallSniffer()
    shown = "".join(plain.feed(piece) for piece in ["<b>a</b> <", "3 \n"])
    assert shown + plain.finish()[0] == "<b>a</b> <3 \n" and not plain.calling


def test_each_api_writes_a_text_and_several_calls_each_as_its_own_item():
    _, calls = parse_tool_calls(f"{PARIS}\n{ROME}")
    done = Answered(0, "Let me look.", Finished(completion_tokens=9), True, tool_calls=tuple(calls))
    ids = [call.id for call in calls]
    chat = Reply.new("m", "fp", chat=True).whole([done]).choices[0]
    assert chat.message.content == "Let me look." and chat.finish_reason == "tool_calls"
    assert [call.id for call in chat.message.tool_calls] == ids
    streamed = [json.loads(e.data) for e in Reply.new("m", "fp", chat=True).calls(0, calls)]
    assert [c["choices"][0]["delta"]["tool_calls"][0]["index"] for c in streamed] == [0, 1]

    response = ResponsesWriter(ResponsesRequest(input="hi"), "m")
    output = response.whole([done]).output
    assert [item["type"] for item in output] == ["message", "function_call", "function_call"]
    assert [item["call_id"] for item in output[1:]] == ids
    response.text(0, "Let me look.", None)
    kinds = [(e.event, json.loads(e.data).get("output_index")) for e in response.calls(0, calls)]
    assert kinds[:3] == [
        ("response.output_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
    ]
    assert {at for kind, at in kinds[3:]} == {1, 2}

    message = MessagesWriter("m")
    content = message.whole([done]).content
    assert [block["type"] for block in content] == ["text", "tool_use", "tool_use"]
    assert len({block["id"] for block in content[1:]}) == 2
    message.text(0, "Let me look.", None)
    blocks = [json.loads(e.data) for e in message.calls(0, calls)]
    assert blocks[0] == {"type": "content_block_stop", "index": 0}
    assert [b["index"] for b in blocks if b["type"] == "content_block_start"] == [1, 2]
