"""A model that escapes half of a surrogate pair into a tool call's arguments (`"\\ud800"`:
valid JSON, no Unicode): every API's answer, whole and streamed, is still Unicode text
(strictly UTF-8, no lone surrogate in any string, the arguments' own text included),
the character written as U+FFFD, never a 500. The generations are scripted
(tests/fixtures/scripted_serve.py); everything from the edge to the writers is serve's."""

from __future__ import annotations

import json
from typing import Any

import pytest

from drafter.serve.tools import parse_tool_calls
from server.shared.request_body import read_json
from tests.fixtures.scripted_serve import scripted_serve

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
# The model's text, as it writes it: backslash-u escapes in the call's JSON. A lone high
# half, a lone low half in a key, and a whole pair (which stays what it is).
ARGUMENTS = '{"city": "Rome\\ud800", "\\udfff": "\\ud83d\\ude00"}'
CALL = f'<tool_call>\n{{"name": "weather", "arguments": {ARGUMENTS}}}\n</tool_call>'
WRITTEN = {"city": "Rome\ufffd", "\ufffd": "\U0001f600"}


@pytest.fixture(scope="module")
def scripted():
    yield from scripted_serve()


def strict(data: bytes) -> Any:
    """JSON as serve reads it (UTF-8, no lone surrogate anywhere): what a strict client
    takes."""
    return read_json(data)


def sse_data(response) -> list[Any]:
    """A stream's events' data, each read strictly."""
    assert response.status_code == 200, response.text
    lines = response.content.splitlines()
    return [
        strict(line[6:]) for line in lines if line.startswith(b"data: ") and line != b"data: [DONE]"
    ]


def arguments(text: str) -> Any:
    return strict(text.encode("utf-8"))


def test_the_call_is_read_with_its_lone_halves_as_replacement_characters():
    text, (call,) = parse_tool_calls("Let me look. " + CALL)
    assert text == "Let me look."
    assert call.function.name == "weather" and arguments(call.function.arguments) == WRITTEN


def chat_body(**extra) -> dict:
    tool = {"type": "function", "function": {"name": "weather", "parameters": WEATHER}}
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    return {"model": "any", "messages": messages, "tools": [tool], **extra}


def test_chat_completions_whole_and_streamed(scripted):
    serve, api = scripted
    serve.answer = CALL
    whole = api.post("/v1/chat/completions", json=chat_body())
    assert whole.status_code == 200, whole.text
    choice = strict(whole.content)["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert (
        choice["finish_reason"] == "tool_calls"
        and arguments(call["function"]["arguments"]) == WRITTEN
    )
    chunks = sse_data(api.post("/v1/chat/completions", json=chat_body(stream=True)))
    calls = [
        c
        for chunk in chunks
        for ch in chunk["choices"]
        for c in ch["delta"].get("tool_calls") or ()
    ]
    (streamed,) = calls
    assert arguments(streamed["function"]["arguments"]) == WRITTEN


def responses_body(**extra) -> dict:
    tool = {"type": "function", "name": "weather", "parameters": WEATHER}
    return {"model": "any", "input": "Weather in Rome?", "tools": [tool], **extra}


def test_responses_whole_and_streamed(scripted):
    serve, api = scripted
    serve.answer = CALL
    whole = api.post("/v1/responses", json=responses_body())
    assert whole.status_code == 200, whole.text
    (item,) = strict(whole.content)["output"]
    assert item["type"] == "function_call" and arguments(item["arguments"]) == WRITTEN
    events = sse_data(api.post("/v1/responses", json=responses_body(stream=True)))
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [arguments(e["arguments"]) for e in done] == [WRITTEN]
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert arguments("".join(deltas)) == WRITTEN
    (completed,) = [e for e in events if e["type"] == "response.completed"]
    assert arguments(completed["response"]["output"][0]["arguments"]) == WRITTEN


def messages_body(**extra) -> dict:
    tool = {"name": "weather", "input_schema": WEATHER}
    question = [{"role": "user", "content": "Weather in Rome?"}]
    return {"model": "any", "max_tokens": 64, "messages": question, "tools": [tool], **extra}


def test_messages_whole_and_streamed(scripted):
    serve, api = scripted
    serve.answer = CALL
    whole = api.post("/v1/messages", json=messages_body())
    assert whole.status_code == 200, whole.text
    body = strict(whole.content)
    (block,) = body["content"]
    assert body["stop_reason"] == "tool_use"
    assert (block["type"], block["name"], block["input"]) == ("tool_use", "weather", WRITTEN)
    events = sse_data(api.post("/v1/messages", json=messages_body(stream=True)))
    partial = [
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    ]
    assert arguments("".join(partial)) == WRITTEN
    assert events[-1]["type"] == "message_stop"


def test_a_whole_pair_and_plain_text_are_written_as_they_were(scripted):
    serve, api = scripted
    serve.answer = CALL.replace(ARGUMENTS, '{"city": "\\u00e9\\ud83d\\ude00"}')
    whole = api.post("/v1/messages", json=messages_body())
    assert strict(whole.content)["content"][0]["input"] == {"city": "\u00e9\U0001f600"}
    serve.answer = "Sunny."
    answer = strict(api.post("/v1/messages", json=messages_body()).content)
    assert answer["content"] == [{"type": "text", "text": "Sunny."}]
    assert (
        json.loads(api.post("/v1/chat/completions", json=chat_body()).content)["choices"][0][
            "message"
        ]["content"]
        == "Sunny."
    )
