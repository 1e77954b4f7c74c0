"""The requests Claude Code and Codex send, as captured (tests/fixtures/agent_requests/),
at `serve`'s edge: each is accepted (it gets as far as the verifier, which is not there:
a 503), what cannot run here is left out of the prompt, and what would change the prompt
with every request (Claude Code's billing line) is not in it. No verifier is needed."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from drafter.serve.app import create_app
from drafter.serve.messages_api import MessagesRequest
from drafter.serve.responses_api import ResponsesRequest
from drafter.settings import DrafterSettings
from tests.fixtures.agent_requests import captured, with_cch

TURNS = ("first", "second", "tool_round")


@pytest.fixture(scope="module")
def api():
    settings = DrafterSettings(server="http://127.0.0.1:9", timeout=2, retries=0)
    with TestClient(create_app(settings), raise_server_exceptions=False) as api:
        yield api


def reached_the_verifier(response) -> None:
    """Accepted: refused only for want of a verifier."""
    assert response.status_code == 503, response.text
    assert "verifier" in response.text


# --- Claude Code: POST /v1/messages?beta=true ---


@pytest.mark.parametrize("turn", TURNS)
def test_claude_codes_requests_are_accepted_as_sent(api, turn):
    agent = captured("claude_code")
    headers = {**agent["headers"], "x-api-key": "x"}
    body = with_cch(agent[turn], "a1b2c")
    response = api.post(agent["path"], json=body, headers=headers)
    reached_the_verifier(response)
    assert response.json()["type"] == "error"  # Anthropic's shape
    counted = {k: v for k, v in body.items() if k != "max_tokens"}
    path = agent["path"].replace("/messages", "/messages/count_tokens")
    reached_the_verifier(api.post(path, json=counted, headers=headers))


def chat_of(body: dict) -> list[tuple[str, str | None]]:
    chat = MessagesRequest.model_validate(body).to_chat()
    return [(m.role, m.text) for m in chat.messages]


def test_the_billing_line_is_not_in_the_prompt_so_a_new_cch_changes_nothing():
    body = captured("claude_code")["second"]
    one, other = chat_of(with_cch(body, "00001")), chat_of(with_cch(body, "fffff"))
    assert one == other
    assert all("x-anthropic-billing-header" not in (text or "") for _, text in one)
    assert one[0][0] == "system" and one[0][1].startswith("You are a Claude agent")


def test_a_system_message_mid_conversation_stays_where_it_was_sent():
    roles = [role for role, _ in chat_of(captured("claude_code")["second"])]
    assert roles == ["system", "user", "system", "assistant", "user"]


def test_the_tool_round_replays_the_call_and_its_result():
    chat = MessagesRequest.model_validate(captured("claude_code")["tool_round"]).to_chat()
    (call,) = chat.messages[3].tool_calls
    assert call.function.name == "Bash" and chat.messages[4].role == "tool"
    assert chat.messages[4].text == "hi"


def test_claude_codes_probe_of_one_token_is_accepted(api):
    quota = [{"role": "user", "content": "quota"}]
    body = {"model": "claude-haiku", "max_tokens": 1, "messages": quota}
    reached_the_verifier(api.post("/v1/messages?beta=true", json=body))


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
         "context_management"),
        ({"context_management": {"edits": [{"type": "clear_thinking_20251015"}], "x": 1}},
         "context_management"),
        ({"context_management": {"edits": [{"type": "clear_thinking_1"}] * 17}},
         "context_management"),
        ({"messages": [{"role": "system", "content": "first"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}, "text blocks"),
    ],
)  # fmt: skip
def test_what_would_change_the_prompt_is_still_refused(api, change, words):
    body = {**captured("claude_code")["first"], **change}
    response = api.post("/v1/messages?beta=true", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"], error


# --- Codex: POST /v1/responses ---


@pytest.mark.parametrize("turn", TURNS)
def test_codexs_requests_are_accepted_as_sent(api, turn):
    agent = captured("codex")
    headers = {**agent["headers"], "authorization": "Bearer x"}
    response = api.post(agent["path"], json=agent[turn], headers=headers)
    reached_the_verifier(response)
    assert response.json()["error"]["code"] == "verifier_unavailable"  # OpenAI's shape


def test_codexs_hosted_tools_are_left_out_with_a_log_line(caplog):
    request = ResponsesRequest.model_validate(captured("codex")["first"])
    assert request.left_out_tools == ["namespace", "web_search"]
    assert [t.name for t in request.tools or ()] == ["exec_command"]
    with caplog.at_level(logging.INFO, logger="drafter.serve.responses_api"):
        chat = request.to_chat()
    assert [t.function.name for t in chat.tools or ()] == ["exec_command"]
    assert "namespace, web_search" in caplog.text


@pytest.mark.parametrize(
    "tool",
    [
        {"type": "web_search_preview"},
        {"type": "web_search_preview_2025_03_11", "search_context_size": "low"},
        {"type": "file_search", "vector_store_ids": ["vs_1"]},
        {"type": "code_interpreter", "container": {"type": "auto"}},
        {"type": "image_generation"},
        {"type": "local_shell"},
        {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}},
        {"type": "mcp", "server_label": "x", "server_url": "https://example.com"},
    ],
)
def test_a_hosted_tool_beside_a_function_is_left_out_not_refused(api, tool):
    function = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    body = {"model": "any", "input": "hi", "tools": [tool, function]}
    reached_the_verifier(api.post("/v1/responses", json=body))
    assert ResponsesRequest.model_validate(body).left_out_tools == [tool["type"]]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search_2025"}]}, "tools"),  # not a date
        ({"tools": [{"type": "web_search"}] * 129}, "tools"),
        ({"tool_choice": {"type": "web_search"}, "tools": [{"type": "web_search"}]},
         "tool_choice"),
        ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice"),
        ({"text": {"verbosity": "loud"}}, "verbosity"),
    ],
)  # fmt: skip
def test_what_cannot_be_done_is_still_a_400(api, extra, param):
    response = api.post("/v1/responses", json={"model": "any", "input": "hi", **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert param in (error["param"] or "") or param in error["message"], error


def test_codexs_other_fields_and_a_one_token_probe_are_accepted(api):
    body = {
        "model": "gpt-5.1-codex",
        "input": "hi",
        "max_output_tokens": 1,
        "text": {"verbosity": "low"},
        "reasoning": {"effort": "high", "summary": "auto"},
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "01a23424",
        "store": False,
        "client_metadata": {"session_id": "01a23424"},
    }
    reached_the_verifier(api.post("/v1/responses", json=body))
