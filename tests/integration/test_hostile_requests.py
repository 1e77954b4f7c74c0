"""Requests built to break `serve` through what it parses: a replayed tool call's deep
arguments, a body nested deeper than a JSON reader recurses. Each is a 400 that says
why, never a 500, and `serve` answers the next request as ever. Real models, a real
`serve` and verifier on 127.0.0.1."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.test_openai_api import LocalAPI

pytestmark = pytest.mark.integration

ASK = {"role": "user", "content": "What is the weather in Paris?"}


@pytest.fixture(scope="module")
def api(live_verifier):
    serve = LocalAPI(live_verifier.url)
    yield serve
    serve.stop()


def still_answers(api: LocalAPI) -> None:
    after = httpx.post(
        f"{api.url}/chat/completions",
        json={"model": "any", "messages": [ASK], "max_tokens": 4, "temperature": 0},
        timeout=120,
    )
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["message"]["content"]


def test_a_replayed_tool_call_with_deep_arguments_is_a_400_and_serve_goes_on(api):
    deep = "[" * 1000 + "]" * 1000
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": deep}
    body = {
        "model": "any",
        "messages": [
            ASK,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
        ],
        "max_tokens": 4,
    }
    response = httpx.post(f"{api.url}/chat/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "nested" in error["message"]
    assert error["param"] == "messages.1.tool_calls.0.function.arguments"
    still_answers(api)


def test_a_body_nested_too_deep_is_invalid_json_and_serve_goes_on(api):
    deep = b'{"model": "any", "messages": ' + b"[" * 2000 + b"]" * 2000 + b"}"
    response = httpx.post(
        f"{api.url}/chat/completions",
        content=deep,
        headers={"content-type": "application/json"},
        timeout=120,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_json" and "nested too deep" in error["message"]
    still_answers(api)
