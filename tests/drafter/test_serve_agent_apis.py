"""The Responses and Messages APIs at `serve`'s edge, as a hostile client finds them:
every bad input a short 400 in the API's own error shape, naming what is wrong; what
changes nothing accepted. No verifier is needed: all of these are decided before the
draft model loads (a request that passes fails later, for want of a verifier). And the
writers' event sequences, from answers made here."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from drafter.serve.app import create_app
from drafter.serve.backend import Finished
from drafter.serve.chat_responses import CalledFunction, ToolCall
from drafter.serve.chat_writer import Answered
from drafter.serve.errors import OpenAIError
from drafter.serve.messages_writer import MessagesWriter
from drafter.serve.responses_api import ResponsesRequest
from drafter.serve.responses_writer import ResponsesWriter
from drafter.settings import DrafterSettings

QUESTION = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
HUGE_SCHEMA = {"type": "object", "description": "x" * 70_000}
DEEP: dict = {}
for _ in range(300):
    DEEP = {"a": DEEP}


def client(**settings) -> TestClient:
    app = create_app(DrafterSettings(server="http://127.0.0.1:9", timeout=2, retries=0, **settings))
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def api():
    with client() as api:
        yield api


def openai_error(response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert len(response.content) < 1024
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert param in (error["param"] or "") or param in error["message"], error
    return error


def anthropic_error(response, status: int, error_type: str, words: str = "") -> dict:
    assert response.status_code == status, response.text
    assert len(response.content) < 1024
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == error_type and words in body["error"]["message"], body
    return body["error"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"input": 42}, "input"),
        ({"input": []}, "input"),
        ({"temperature": 3}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"metadata": "x"}, "metadata"),
        ({"metadata": {"a": "x" * 513}}, "metadata"),
        ({"tools": [{"type": "function", "name": "f", "parameters": DEEP}]}, "parameters"),
        ({"text": {"format": {"type": "json_schema", "schema": DEEP}}}, "schema"),
        ({"prompt_cache_option": {}}, "'prompt_cache_options'"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"tools": [{"type": "web_searches"}]}, "tools"),  # no such type (web_search is)
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "schema": HUGE_SCHEMA}}}, "response_format"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]}, "c9"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f",
                        "arguments": "[" * 1000 + "]" * 1000}]},
            "arguments",
        ),
    ],
)  # fmt: skip
def test_bad_responses_fields_are_400s_in_openai_shape_naming_them(api, extra, param):
    body = {"model": "any", "input": "hi", **extra}
    openai_error(api.post("/v1/responses", json=body), 400, param)


def test_a_misspelled_responses_field_names_the_field_meant(api):
    response = api.post("/v1/responses", json={"input": "hi", "max_output_token": 8})
    error = openai_error(response, 400, "max_output_token")
    assert error["code"] == "unknown_parameter" and "'max_output_tokens'" in error["message"]


def test_responses_fields_that_change_nothing_here_are_accepted(api):
    harmless = {
        "metadata": {"a": "b"},
        "store": False,
        "reasoning": {"effort": "low"},
        "parallel_tool_calls": True,
        "truncation": "auto",
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_options": {},
        "user": "me",
        "text": {"format": {"type": "text"}, "verbosity": "medium"},
    }
    response = api.post("/v1/responses", json={"input": "hi", **harmless})
    assert openai_error(response, 503)["code"] == "verifier_unavailable"
    counted = api.post("/v1/responses/input_tokens", json={"input": "hi"})
    assert openai_error(counted, 503)["code"] == "verifier_unavailable"


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"messages": QUESTION}, "max_tokens"),
        ({"max_tokens": 8, "messages": "hi"}, "messages"),
        ({"max_tokens": 8, "messages": []}, "messages"),
        ({"max_tokens": 8, "messages": QUESTION, "temperature": 1.5}, "temperature"),
        ({"max_tokens": 8, "messages": QUESTION, "stop_sequence": ["x"]}, "'stop_sequences'"),
        ({"max_tokens": 8, "messages": QUESTION, "stop_sequences": list("abcde")}, "at most"),
        ({"max_tokens": 8, "messages": QUESTION, "mcp_servers": [{"url": "x"}]}, "mcp_servers"),
        ({"max_tokens": 8, "messages": QUESTION, "context_management": {}}, "context_management"),
        ({"max_tokens": 8, "messages": QUESTION, "stop_sequences": ["x" * 2000]}, "stop_sequences"),
        ({"max_tokens": 8, "messages": QUESTION, "tools": [{"name": "f", "input_schema": DEEP}]},
         "input_schema"),
        (
            {"max_tokens": 8, "messages": [*QUESTION, {"role": "assistant", "content": [
                {"type": "tool_use", "id": "t", "name": "f", "input": DEEP}]}]},
            "nested deeper",
        ),
        (
            {"max_tokens": 8, "messages": [*QUESTION, {"role": "assistant", "content": "{"}],
             "output_config": {"format": {"type": "json_schema", "schema": WEATHER}}},
            "prefill",
        ),
        (
            {"max_tokens": 8, "tool_choice": {"type": "any"}, "messages": QUESTION},
            "tool_choice",
        ),
        ({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, "role"),
        (
            {"max_tokens": 8, "messages": [{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]},
            "toolu_9",
        ),
        (
            {"max_tokens": 8, "messages": [{"role": "user", "content": [
                {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
            "assistant",
        ),
        (
            {"max_tokens": 8, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {}}]}]},
            "content",
        ),
        (
            {"max_tokens": 8, "messages": [{"role": "user", "content": [
                {"type": "thinking", "thinking": "x", "signature": "s"}]}]},
            "assistant",
        ),
        (
            {"max_tokens": 8, "messages": QUESTION, "tool_choice": {"type": "tool"},
             "tools": [{"name": "f", "input_schema": WEATHER}]},
            "name",
        ),
        (
            {"max_tokens": 8, "messages": QUESTION,
             "tools": [{"name": "big", "input_schema": HUGE_SCHEMA}]},
            "tools",
        ),
        ({"max_tokens": 8, "messages": QUESTION, "tools": [{"type": "web_search_20250305",
                                                            "name": "web_search"}]}, "tools"),
    ],
)  # fmt: skip
def test_bad_messages_are_400s_in_anthropic_shape_saying_why(api, body, words):
    response = api.post("/v1/messages", json={"model": "any", **body})
    anthropic_error(response, 400, "invalid_request_error", words)


def test_messages_fields_that_change_nothing_here_are_accepted(api):
    harmless = {
        "metadata": {"user_id": "u"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "cache_control": {"type": "ephemeral"},
        "output_config": {"effort": "low"},
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
    }
    thought = {"type": "thinking", "thinking": "Greet.", "signature": "s"}
    replayed = [
        *QUESTION,
        {"role": "assistant", "content": [thought, {"type": "text", "text": "Hello."}]},
        *QUESTION,
    ]
    body = {"model": "any", "max_tokens": 8, "messages": replayed, **harmless}
    anthropic_error(api.post("/v1/messages", json=body), 503, "api_error", "verifier")
    counted = api.post("/v1/messages/count_tokens", json={"model": "any", "messages": QUESTION})
    anthropic_error(counted, 503, "api_error", "verifier")


def test_the_messages_paths_answer_every_failure_in_anthropic_shape(api):
    bad_json = api.post("/messages", content=b"{", headers={"content-type": "application/json"})
    anthropic_error(bad_json, 400, "invalid_request_error", "JSON")
    huge = api.post(
        "/v1/messages",
        content=b"x" * (DrafterSettings().max_body_bytes + 1),
        headers={"content-type": "application/json"},
    )
    anthropic_error(huge, 413, "request_too_large")
    anthropic_error(api.get("/v1/messages"), 405, "invalid_request_error")
    anthropic_error(api.post("/v1/messages/nothing", json={}), 404, "not_found_error")
    with client(serve_api_key="sk-mine") as keyed:
        for headers in ({}, {"x-api-key": "sk-other"}):
            response = keyed.post("/v1/messages", json={}, headers=headers)
            anthropic_error(response, 401, "authentication_error")
        openai_error(keyed.post("/v1/responses", json={}), 401)
        allowed = keyed.post(
            "/v1/messages",
            json={"max_tokens": 8, "messages": QUESTION},
            headers={"x-api-key": "sk-mine"},
        )
        anthropic_error(allowed, 503, "api_error")


# --- The writers' shapes, from answers made here ---


def answered(text: str, reason: str = "stop", call: ToolCall | None = None, stop=None):
    finished = Finished(
        prompt_tokens=20,
        cached_tokens=5,
        completion_tokens=7,
        finish_reason=reason,
        stop_sequence=stop,
    )
    return Answered(0, "" if call else text, finished, True, tool_calls=(call,) if call else ())


CALL = ToolCall(id="call_abc", function=CalledFunction(name="f", arguments='{"city": "Rome"}'))


def events(writer, pieces: list[str], done: Answered) -> list[tuple[str | None, dict | str]]:
    out = [*writer.opening(0, 20)]
    for piece in pieces:
        out += writer.text(0, piece, None)
    if done.tool_calls:
        out += writer.calls(0, done.tool_calls)
    out += writer.ending(done)
    out += writer.closing([done], False)
    return [(e.event, json.loads(e.data)) for e in out]


def test_a_streamed_response_numbers_its_events_in_openai_order():
    request = ResponsesRequest(input="hi", max_output_tokens=7)
    text = events(ResponsesWriter(request, "m"), ["Hel", "lo"], answered("", "length"))
    assert [kind for kind, _ in text] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [body["sequence_number"] for _, body in text] == list(range(10))
    assert all(body["type"] == kind for kind, body in text)
    last = text[-1][1]["response"]
    assert last["output"][0]["content"][0]["text"] == "Hello"
    assert last["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["usage"]["input_tokens_details"]["cached_tokens"] == 5
    called = events(ResponsesWriter(request, "m"), [], answered("", call=CALL))
    assert [kind for kind, _ in called][2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert called[-1][1]["response"]["output"][0]["call_id"] == "call_abc"
    failed = ResponsesWriter(request, "m").failure(OpenAIError(503, "gone", "verifier_error"))
    assert [e.event for e in failed] == ["error", "response.failed"]
    assert json.loads(failed[1].data)["response"]["status"] == "failed"


def test_a_streamed_message_follows_anthropics_order_and_reasons():
    text = events(MessagesWriter("m"), ["Hel", "lo"], answered("", stop="\n\n"))
    assert [kind for kind, _ in text] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert text[0][1]["message"]["content"] == [] and text[0][1]["message"]["usage"]
    delta = text[-2][1]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "\n\n"}
    assert delta["usage"]["input_tokens"] == 15 and delta["usage"]["cache_read_input_tokens"] == 5
    called = events(MessagesWriter("m"), [], answered("", call=CALL))
    block = called[1][1]["content_block"]
    assert (block["type"], block["name"], block["input"]) == ("tool_use", "f", {})
    assert called[2][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "Rome"}'}
    assert called[-2][1]["delta"]["stop_reason"] == "tool_use"
    whole = MessagesWriter("m").whole([answered("Hi", "length")])
    assert whole.stop_reason == "max_tokens" and whole.content == [{"type": "text", "text": "Hi"}]
    failed = MessagesWriter("m").failure(OpenAIError(429, "full", "rate_limit_error"))
    assert failed[0].event == "error"
    assert json.loads(failed[0].data)["error"] == {"type": "rate_limit_error", "message": "full"}
