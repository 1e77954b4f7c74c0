"""Text that is not Unicode at `serve`'s edge, as a hostile client sends it: a lone
surrogate ("\\ud800" is valid JSON text, and no UTF-8 can carry it) in any string field
of any API, keys included, or a body that is not UTF-8. Each is a 400 in the API's own
shape naming the field, streamed or not, before any work; the same bodies with the text
made whole pass the edge (and fail only for want of a verifier). No verifier is needed."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from drafter.serve.app import create_app
from drafter.settings import DrafterSettings

LONE = "\ud800"
PAIR = "\U0001f600"  # the same escape's form where it is whole: "\ud83d\ude00"
QUESTION = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


@pytest.fixture(scope="module")
def api():
    app = create_app(DrafterSettings(server="http://127.0.0.1:9", timeout=2, retries=0))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def chat(**fields) -> dict:
    return {"model": "any", "messages": QUESTION, **fields}


def replayed_call(arguments: str) -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]}]


def message(**fields) -> dict:
    return {"model": "any", "max_tokens": 8, "messages": QUESTION, **fields}


def tool(parameters: dict, description: str = "d") -> dict:
    return {"type": "function", "function": {"name": "f", "description": description,
                                             "parameters": parameters}}  # fmt: skip


# (path, body with X where the text goes, the field's path with X as it is named)
CASES = [
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "aX"}]),
     "messages.0.content"),
    ("/v1/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "text", "text": "X"}]}]),
     "messages.0.content.0.text"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "enum": ["X"]}}}),
     "response_format.json_schema.schema.enum.0"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"X": {}}}}}),
     "response_format.json_schema.schema.properties.X"),
    ("/v1/chat/completions", chat(tools=[tool(SCHEMA, "X")]), "tools.0.function.description"),
    ("/v1/chat/completions", chat(tools=[tool({"type": "object", "properties": {"X": {}}})]),
     "tools.0.function.parameters.properties.X"),
    ("/v1/chat/completions", chat(stop=["ok", "X"]), "stop.1"),
    ("/v1/chat/completions", chat(messages=replayed_call('{"city": "X"}')),
     "messages.1.tool_calls.0.function.arguments"),
    ("/v1/chat/completions", chat(metadata={"k": "X"}), "metadata.k"),
    ("/v1/chat/completions", chat(user="X"), "user"),
    ("/v1/chat/completions", chat(X=1), "X"),  # an unknown field's name
    ("/v1/chat/completions", chat(grammar='root ::= "X"'), "grammar"),
    ("/v1/completions", {"model": "any", "prompt": ["ok", "X"]}, "prompt.1"),
    ("/v1/completions", {"model": "any", "prompt": "p", "suffix": "X"}, "suffix"),
    ("/v1/completions", {"model": "any", "prompt": "p", "json_schema": {"title": "X"}},
     "json_schema.title"),
    ("/v1/responses", {"model": "any", "input": "X"}, "input"),
    ("/v1/responses", {"model": "any", "input": "hi", "instructions": "X"}, "instructions"),
    ("/v1/responses", {"model": "any", "input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"X": 1}}}}, "text.format.schema.X"),
    ("/v1/responses", {"model": "any", "input": "hi", "tools": [
        {"type": "function", "name": "f", "parameters": {"description": "X"}}]},
     "tools.0.parameters.description"),
    ("/v1/responses", {"model": "any", "input": [
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "X"}]}, "input.1.output"),
    ("/v1/responses", {"model": "any", "input": "hi", "metadata": {"k": "X"}}, "metadata.k"),
    ("/v1/responses/input_tokens", {"model": "any", "input": "X"}, "input"),
    ("/v1/messages", message(messages=[{"role": "user", "content": "X"}]),
     "messages.0.content"),
    ("/v1/messages", message(system=[{"type": "text", "text": "X"}]), "system.0.text"),
    ("/v1/messages", message(stop_sequences=["X"]), "stop_sequences.0"),
    ("/v1/messages", message(tools=[{"name": "f", "input_schema": {"title": "X"}}]),
     "tools.0.input_schema.title"),
    ("/v1/messages", message(messages=[*QUESTION, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {"X": 1}}]}, {"role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}]),
     "messages.1.content.0.input.X"),
    ("/v1/messages", message(output_config={"format": {"type": "json_schema", "schema": {
        "type": "string", "enum": ["X"]}}}), "output_config.format.schema.enum.0"),
    ("/v1/messages", message(metadata={"user_id": "X"}), "metadata.user_id"),
    ("/v1/messages/count_tokens", {"model": "any", "messages": [
        {"role": "user", "content": "X"}]}, "messages.0.content"),
]  # fmt: skip


def raw(body: dict, text: str) -> bytes:
    """The body as a client writes it, `text` where X is: json's ASCII escapes, which is
    how a lone surrogate travels ("\\ud800")."""
    return json.dumps(body).replace("X", json.dumps(text)[1:-1]).encode()


def post(api: TestClient, path: str, content: bytes):
    return api.post(path, content=content, headers={"content-type": "application/json"})


def refusal(response, path: str) -> tuple[str, str | None]:
    """(message, param) of a 400 in the shape of the API at `path`."""
    assert response.status_code == 400, response.text
    assert len(response.content) < 1024
    body = json.loads(response.content.decode("utf-8"))  # strictly UTF-8 itself
    if "/messages" in path:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        assert body["error"]["type"] == "invalid_request_error"
        return body["error"]["message"], None
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_json")
    return error["message"], error["param"]


@pytest.mark.parametrize(("path", "body", "field"), CASES)
@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_surrogate_in_any_field_is_a_400_naming_it(api, path, body, field, stream):
    if stream and not path.endswith(("completions", "responses", "messages")):
        pytest.skip("no stream on this path")
    body = {**body, "stream": True} if stream else body
    named = field.replace("X", "a\\ud800")  # the key as the message writes it
    message, param = refusal(post(api, path, raw(body, "a" + LONE)), path)
    assert message.startswith(f"{named}: ") and "lone surrogate" in message
    assert param in (None, named)


@pytest.mark.parametrize(("path", "body", "field"), CASES)
def test_the_same_fields_with_whole_text_pass_the_edge(api, path, body, field):
    """A pair spelled in escapes, and the six characters `\\ud800` as text, are Unicode:
    past the edge, only the missing verifier answers (503)."""
    if field == "X":
        pytest.skip("an unknown field, whatever its name")
    for text in (PAIR, "\\ud800"):
        response = post(api, path, raw(body, text))
        assert response.status_code == 503, (field, response.text)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "X"}])),
        ("/v1/completions", {"model": "any", "prompt": "X"}),
        ("/v1/responses", {"model": "any", "input": "X"}),
        ("/v1/messages", message(messages=[{"role": "user", "content": "X"}])),
    ],
)
def test_a_body_that_is_not_utf8_is_a_400_saying_so(api, path, body):
    """Not UTF-8: invalid bytes, a surrogate's own bytes, UTF-16 (which json alone reads)."""
    text = json.dumps(body)
    for content in (
        text.replace("X", "\xff").encode("latin-1"),
        text.encode().replace(b"X", LONE.encode("utf-8", "surrogatepass")),
        text.replace("X", "hi").encode("utf-16"),
    ):
        found, param = refusal(post(api, path, content), path)
        assert "not UTF-8" in found and param is None
    assert post(api, path, text.replace("X", "hi").encode()).status_code == 503
