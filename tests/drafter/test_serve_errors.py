"""`serve` as a hostile client finds it: every bad input an OpenAI-shaped 4xx, short,
naming what is wrong; never a 500. No verifier is needed: all of these are refused before
the draft model loads."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from drafter.errors import VerifierRejected, VerifierUnavailable
from drafter.serve.app import create_app
from drafter.serve.errors import as_openai_error
from drafter.serve.slots import QueueFull
from drafter.settings import DrafterSettings


@pytest.fixture(scope="module")
def api():
    app = create_app(DrafterSettings(server="http://127.0.0.1:9", timeout=2, retries=0))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def assert_openai_error(response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert len(response.content) < 1024
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert param in (error["param"] or "") or param in error["message"]
    return error


COMPLETION = {"model": "any", "prompt": "hi", "max_tokens": 4}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"seed": 2**63}, "seed"),
        ({"seed": -1}, "seed"),
        ({"temperature": float("nan")}, None),  # NaN is not JSON: malformed
        ({"temperature": 3}, "temperature"),
        ({"n": 17}, "n"),
        ({"prompt": ["a"] * 9, "n": 2}, "choices"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({"prompt": [1, -1]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": "x" * 5000}, "stop"),
        ({"prompt": 42}, "prompt"),
        ({"logprobs": 6}, "logprobs"),
        ({"best_of": 3}, "best_of"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"echo": True, "logprobs": 1}, "logprobs"),
        ({"min_p": 0.1}, "min_p"),
        ({"logit_bias": {"50": 101}}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"top_k": -1}, "top_k"),
        ({"grammar": 5}, "grammar"),
        ({"grammar": "root ::= [a-z]+", "json_schema": {"type": "object"}}, "json_schema"),
        ({"n_predict": 8}, "n_predict"),
    ],
)
def test_bad_completion_fields_are_400s_naming_the_field(api, extra, param):
    body = json.dumps({**COMPLETION, **extra}, allow_nan=True)
    response = api.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert_openai_error(response, 400, param)


def test_a_lone_surrogate_in_a_prompt_or_message_is_a_400(api):
    raw = '{"model": "any", "prompt": "\\ud800", "max_tokens": 4}'
    response = api.post(
        "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert_openai_error(response, 400, "prompt")
    chat = '{"model": "any", "messages": [{"role": "user", "content": "\\udfff"}]}'
    response = api.post(
        "/v1/chat/completions", content=chat, headers={"content-type": "application/json"}
    )
    assert_openai_error(response, 400, "messages")


def test_unsupported_chat_fields_are_refused_not_ignored(api):
    body = {"model": "any", "messages": [{"role": "user", "content": "hi"}]}
    for extra in ({"functions": [{"name": "f"}]}, {"prediction": {"type": "content"}}):
        error = assert_openai_error(api.post("/v1/chat/completions", json={**body, **extra}), 400)
        assert error["code"] == "unsupported_parameter"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for extra, param in (
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "json"}}, "response_format"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "g"}}}, None),
        ({"tools": [tool], "response_format": {"type": "json_object"}}, "tools"),
        ({"tools": [tool], "logprobs": True}, None),
    ):
        assert_openai_error(api.post("/v1/chat/completions", json={**body, **extra}), 400, param)
    # What changes nothing is accepted (it then fails only for want of a verifier).
    harmless = api.post("/v1/chat/completions", json={**body, "user": "me", "metadata": {}})
    assert harmless.status_code == 503


def test_malformed_json_and_huge_error_lists_give_short_answers(api):
    bad = api.post("/v1/completions", content=b"{", headers={"content-type": "application/json"})
    assert assert_openai_error(bad, 400)["code"] == "invalid_json"
    many = {"model": "any", "messages": [{"role": "nobody", "content": 1}] * 1000}
    error = assert_openai_error(api.post("/v1/chat/completions", json=many), 400)
    assert "more" in error["message"]


def test_bodies_over_the_limit_are_413_before_being_read(api):
    huge = b"x" * (DrafterSettings().max_body_bytes + 1)
    response = api.post(
        "/v1/completions", content=huge, headers={"content-type": "application/json"}
    )
    assert_openai_error(response, 413)


def test_unknown_routes_and_methods_answer_in_openai_shape(api):
    assert assert_openai_error(api.get("/v1/nothing"), 404)["code"] == "not_found"
    assert assert_openai_error(api.get("/v1/completions"), 405)["code"] == "method_not_allowed"


def test_a_tiny_temperature_is_greedy_not_an_overflow():
    from drafter.serve.chat_api import CompletionRequest

    for tiny in (5e-324, 1e-310, 1e-6):
        sampling = CompletionRequest(prompt="x", temperature=tiny).sampling()
        assert sampling.greedy and sampling.temperature == 0.0


def test_health_says_the_verifier_is_down(api):
    response = api.get("/health")
    assert response.status_code == 503
    assert response.json()["status"] == "unavailable"
    assert "cannot be reached" in response.json()["verifier"]


@pytest.mark.parametrize(
    ("path", "body", "typo", "meant"),
    [
        ("/v1/completions", COMPLETION, "max_token", "max_tokens"),
        ("/v1/completions", COMPLETION, "temprature", "temperature"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "sed", "seed"),
    ],
)
def test_a_misspelled_field_is_a_400_naming_it_and_the_field_meant(api, path, body, typo, meant):
    response = api.post(path, json={**body, typo: 5})
    error = assert_openai_error(response, 400, typo)
    assert error["code"] == "unknown_parameter" and repr(meant) in error["message"]


def test_fields_of_the_openai_api_that_change_nothing_here_are_accepted(api):
    response = api.post("/v1/completions", json={**COMPLETION, "user": "u", "metadata": {}})
    assert response.status_code != 400, response.text  # refused later: no verifier here


@pytest.mark.parametrize(
    ("raised", "status", "code"),
    [
        (VerifierRejected(401, "unauthorized", "no key"), 502, "verifier_unauthorized"),
        (VerifierRejected(413, "prompt_too_long", "too long"), 400, "context_length_exceeded"),
        (VerifierRejected(400, "invalid_token", "bad id"), 400, "invalid_token"),
        (VerifierRejected(409, "session_busy", "busy"), 409, "session_busy"),
        (VerifierRejected(503, "server_full", "full"), 503, "server_full"),
        (VerifierRejected(500, "decode_failed", "broke"), 502, "decode_failed"),
        (VerifierUnavailable("cannot reach the verifier"), 503, "verifier_unavailable"),
        (QueueFull("full"), 429, "queue_full"),
    ],
)
def test_what_the_verifier_answers_becomes_the_openai_error_it_means(raised, status, code):
    """The verifier's refusals as `serve`'s client reads them: its own mistakes 400, the
    verifier's trouble 502/503, `serve`'s key refused a 502 naming that key."""
    error = as_openai_error(raised)
    assert (error.status, error.code) == (status, code)
    if code == "verifier_unauthorized":
        assert "--api-key" in error.message
    if code == "queue_full":
        assert error.headers == {"Retry-After": "2"}


def test_a_constraint_too_large_is_a_400_naming_its_field(api):
    huge = {"type": "object", "description": "x" * 70_000}
    body = {"model": "any", "messages": [{"role": "user", "content": "hi"}]}
    form = {"type": "json_schema", "json_schema": {"name": "big", "schema": huge}}
    response = api.post("/v1/chat/completions", json={**body, "response_format": form})
    assert assert_openai_error(response, 400, "response_format")["param"] == "response_format"
    response = api.post("/v1/completions", json={**COMPLETION, "grammar": "x" * 70_000})
    assert assert_openai_error(response, 400, "grammar")["param"] == "grammar"


def test_a_replayed_tool_calls_arguments_nested_too_deep_are_a_400_naming_them(api):
    """Read again for the chat template, such arguments would run json's recursion out;
    brackets inside their strings do not count."""
    messages = [{"role": "user", "content": "hi"}]

    def replayed(arguments: str) -> dict:
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
        turn = {"role": "assistant", "content": None, "tool_calls": [call]}
        return {"model": "any", "messages": [*messages, turn]}

    deep = api.post("/v1/chat/completions", json=replayed("[" * 1000 + "]" * 1000))
    error = assert_openai_error(deep, 400, "messages.1.tool_calls.0.function.arguments")
    assert "nested deeper than" in error["message"]
    quoted = json.dumps({"text": "[" * 1000})
    assert api.post("/v1/chat/completions", json=replayed(quoted)).status_code == 503


def test_a_body_nested_too_deep_to_read_is_invalid_json_saying_so(api):
    deep = b'{"model": "any", "prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}"
    response = api.post(
        "/v1/completions", content=deep, headers={"content-type": "application/json"}
    )
    error = assert_openai_error(response, 400)
    assert error["code"] == "invalid_json" and "nested too deep" in error["message"]
