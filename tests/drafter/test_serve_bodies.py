"""How large a body `serve` takes, decided before it is read: a Content-Length over the cap
is a 413 in the API's own shape with not a byte of the body asked for, a chunked body is
refused as soon as it passes the cap, and a body within it is answered as before. Once
the verifier's context is known the cap is what a request could use with it, learned
whole. A large body is parsed and validated on the render gate's threads, under its bound,
and refused in the same words as a small one. No verifier is needed: the app is called as
ASGI, or its generations are scripted."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from typing import Any

import pytest

import drafter.serve.body_bounds as body_bounds
import drafter.serve.routes as routes
from drafter.serve.app import create_app
from drafter.serve.body_bounds import (
    OTHER_FIELDS_BYTES,
    PARSED_ON_THE_LOOP_BYTES,
    BodyBounds,
    LearnedContext,
    read_request,
)
from drafter.settings import DrafterSettings
from tests.fixtures.scripted_serve import scripted_serve

OPENAI_PATHS = ["/v1/chat/completions", "/v1/responses", "/v1/completions"]
ANTHROPIC_PATHS = ["/v1/messages", "/v1/messages/count_tokens"]
CHUNK = 64 << 10
N_CTX, LONGEST = 512, 32  # a small context learned by hand, as a load learns it


def settings(**more: Any) -> DrafterSettings:
    return DrafterSettings(server="http://127.0.0.1:9", timeout=2, retries=0, **more)


class Posted:
    """A POST made straight to the app as ASGI: what it answered, and how many times it
    asked for the body."""

    def __init__(self, app, path: str, headers: list[tuple[bytes, bytes]], chunks: int | None):
        self.asked = 0
        self.sent: list[dict] = []

        async def receive() -> dict:
            self.asked += 1
            if chunks is not None and self.asked > chunks:
                return {"type": "http.disconnect"}
            return {"type": "http.request", "body": b" " * CHUNK, "more_body": True}

        async def send(message: dict) -> None:
            self.sent.append(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
            "root_path": "", "query_string": b"", "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 8080),
            "headers": [(b"content-type", b"application/json"), *headers],
        }  # fmt: skip
        asyncio.run(app(scope, receive, send))
        self.status = self.sent[0]["status"]
        self.body = json.loads(self.sent[1]["body"])


def refused_in_shape(posted: Posted, path: str, status: int = 413) -> str:
    """The message of a refusal in the shape of the API at `path`."""
    assert posted.status == status, posted.body
    if path in ANTHROPIC_PATHS:
        assert posted.body["type"] == "error" and set(posted.body["error"]) == {"type", "message"}
        assert posted.body["error"]["type"] == "request_too_large"
        return posted.body["error"]["message"]
    error = posted.body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("invalid_request_error", "payload_too_large")
    return error["message"]


@pytest.mark.parametrize("path", OPENAI_PATHS + ANTHROPIC_PATHS)
def test_a_content_length_over_the_cap_is_refused_before_the_body_is_read(path):
    app = create_app(settings(max_body_bytes=100_000))
    posted = Posted(app, path, [(b"content-length", b"100001")], chunks=None)
    assert "over 100000 bytes" in refused_in_shape(posted, path)
    assert posted.asked == 0
    # Once the verifier's context is known: what a request could use with it.
    app = create_app(settings())
    app.state.backend.body_bounds.learn(N_CTX, N_CTX * LONGEST)
    cap = app.state.backend.body_bounds.useful_bytes(path)
    posted = Posted(app, path, [(b"content-length", b"%d" % (cap + 1))], chunks=None)
    message = refused_in_shape(posted, path)
    assert f"over {cap} bytes" in message and f"context of {N_CTX} tokens" in message
    assert posted.asked == 0


@pytest.mark.parametrize("path", OPENAI_PATHS + ANTHROPIC_PATHS)
def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_cap(path):
    """No Content-Length: the body is asked for chunk by chunk, and no more once the
    chunks passed the cap (the client would send forever)."""
    app = create_app(settings(max_body_bytes=10 * CHUNK + 1))
    posted = Posted(app, path, [], chunks=None)
    refused_in_shape(posted, path)
    assert posted.asked == 11


def test_the_cap_is_what_the_context_can_use_and_never_over_the_setting():
    bounds = BodyBounds(4 << 20)
    assert bounds({"path": "/v1/messages"})[0] == 4 << 20  # the context not known yet
    bounds.learn(N_CTX, N_CTX * LONGEST)
    one = 3 * N_CTX * LONGEST + 64 * N_CTX
    assert bounds({"path": "/v1/messages"})[0] == one + OTHER_FIELDS_BYTES
    assert bounds({"path": "/v1/chat/completions"})[0] == one + OTHER_FIELDS_BYTES
    # Completions take a prompt a choice, each as long as the context.
    assert bounds({"path": "/completions"})[0] == 16 * one + OTHER_FIELDS_BYTES
    bounds.learn(1 << 17, (1 << 17) * 128)  # a long context: the setting is the cap
    assert bounds({"path": "/v1/messages"}) == (4 << 20, "this server's limit (--max-body-bytes)")


class LearnedWhileCapping(BodyBounds):
    """Bounds whose context changes just after each read of it (`learned`: what each read
    finds, the last for good), as if the load's thread learned between any two reads of
    one request's: a request that read it twice would be capped by a mix of two."""

    learned: list[LearnedContext | None]

    @property
    def context(self) -> LearnedContext | None:
        return self.learned.pop(0) if len(self.learned) > 1 else self.learned[0]

    @context.setter
    def context(self, value: LearnedContext | None) -> None:
        self.learned = [value]


SHORT = LearnedContext(N_CTX, N_CTX * LONGEST)
LONG = LearnedContext(4 * N_CTX, 4 * N_CTX * LONGEST)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/completions"])
@pytest.mark.parametrize(
    ("read", "then"),
    [(None, SHORT), (SHORT, LONG), (LONG, SHORT), (SHORT, None)],
    ids=["unknown-then-short", "short-then-long", "long-then-short", "short-then-unknown"],
)
def test_a_request_is_capped_by_one_context_learned_whole(path, read, then):
    """Whatever is learned after a request's read, its cap and the words of its 413 are
    the context's it read, as if nothing had changed."""
    alone = BodyBounds(64 << 20)
    alone.context = read
    changing = LearnedWhileCapping(64 << 20)
    changing.learned = [read, then]
    assert changing({"path": path}) == alone({"path": path})
    changing.learned = [read, then]
    assert changing.useful_bytes(path) == alone.useful_bytes(path)
    if read is not None:
        assert f"context of {read.n_ctx} tokens" in alone({"path": path})[1]
    with pytest.raises(dataclasses.FrozenInstanceError):  # replaced whole, never changed
        SHORT.n_ctx = LONG.n_ctx  # type: ignore[misc]


@pytest.fixture(scope="module")
def scripted():
    yield from scripted_serve()


def chat_of(chars: int) -> bytes:
    body = {"model": "any", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * chars}]}
    return json.dumps(body).encode()


def test_a_body_within_the_learned_cap_is_answered_and_one_byte_more_is_not(scripted):
    serve, api = scripted
    serve.answer = "Fine."
    bounds = serve.app.state.backend.body_bounds
    bounds.learn(N_CTX, N_CTX * LONGEST)
    try:
        cap = bounds.useful_bytes("/v1/messages")
        at_cap = chat_of(cap - len(chat_of(0)))
        assert len(at_cap) == cap
        headers = {"content-type": "application/json"}
        answered = api.post("/v1/messages", content=at_cap, headers=headers)
        assert answered.status_code == 200, answered.text
        assert answered.json()["content"] == [{"type": "text", "text": "Fine."}]
        over = api.post("/v1/messages", content=chat_of(cap + 1 - len(chat_of(0))), headers=headers)
        assert over.status_code == 413 and over.json()["error"]["type"] == "request_too_large"
    finally:
        bounds.context = None


def test_a_large_body_is_parsed_and_validated_on_the_render_gates_threads(scripted, monkeypatch):
    """Where the body is read and where its request is made, and that the route is handed
    that very request (FastAPI makes no other on the loop)."""
    serve, api = scripted
    serve.answer = "Fine."
    made: list[tuple[str, str, Any]] = []  # (what, the thread, the request made)

    def recorded(body: bytes, validate: Any) -> Any:
        def validated(value: Any) -> Any:
            request = validate(value)
            made.append(("validated", threading.current_thread().name, request))
            return request

        made.append(("parsed", threading.current_thread().name, None))
        return read_request(body, validated)

    def checked(request: Any) -> None:
        made.append(("routed", threading.current_thread().name, request))
        check_fields(request)

    check_fields = routes.check_fields
    monkeypatch.setattr(body_bounds, "read_request", recorded)
    monkeypatch.setattr(routes, "check_fields", checked)
    small, large = chat_of(10), chat_of(PARSED_ON_THE_LOOP_BYTES)
    for body in (small, large):
        made.clear()
        answered = api.post(
            "/v1/messages", content=body, headers={"content-type": "application/json"}
        )
        assert answered.status_code == 200, answered.text
        (parsed, parsed_on, _), (_, validated_on, request), (_, routed_on, routed) = made
        assert parsed == "parsed" and validated_on == parsed_on and routed is request
        assert parsed_on.startswith("render") == (body is large)
        assert not routed_on.startswith("render")


@pytest.mark.parametrize("size", ["small", "large"])
def test_what_validation_found_reaches_the_route(scripted, monkeypatch, size):
    """FastAPI takes the request made where the body was read as it is: the hosted tools
    a Responses request left out (found as it was validated) are still known."""
    _, api = scripted
    routed: list[Any] = []
    monkeypatch.setattr(routes, "check_fields", routed.append)
    function = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    body = {"model": "any", "input": "hi", "tools": [{"type": "web_search_preview"}, function]}
    api.post("/v1/responses", json=padded(body) if size == "large" else body)
    (request,) = routed
    assert request.left_out_tools == ["web_search_preview"]
    assert [tool.name for tool in request.tools] == ["f"]


def padded(body: dict[str, Any]) -> dict[str, Any]:
    """`body` and a field no model holds, past the size parsed on the loop (every request
    takes fields it does not know until it is validated: refused, if at all, after)."""
    return {**body, "padding": "x" * PARSED_ON_THE_LOOP_BYTES}


USER = {"role": "user", "content": "hi"}
INVALID_BODIES = [
    ("/v1/chat/completions", {"model": "m", "messages": []}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "robot"}], "n": "two"}),
    ("/v1/chat/completions", {"model": "m", "messages": [USER], "tool_choice": "required"}),
    ("/v1/completions", {"model": "m", "prompt": "hi", "echo": True, "logprobs": 1}),
    ("/v1/completions", {"model": "m", "prompt": [[]]}),
    ("/v1/responses", {"model": "m", "input": 5}),
    ("/v1/messages", {"model": "m", "messages": [USER]}),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user"}]}),
    ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": 5}]}),
]


@pytest.mark.parametrize(("path", "body"), INVALID_BODIES)
def test_a_large_invalid_body_is_refused_in_the_same_words_as_a_small_one(scripted, path, body):
    _, api = scripted
    small, large = api.post(path, json=body), api.post(path, json=padded(body))
    assert len(large.request.content) > PARSED_ON_THE_LOOP_BYTES >= len(small.request.content)
    assert small.status_code == 400, small.text
    assert (large.status_code, large.json()) == (small.status_code, small.json())


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_large_body_is_refused_as_a_small_one_is_and_429_when_the_gate_is_full(scripted, path):
    _, api = scripted
    headers = {"content-type": "application/json"}
    pad = "x" * PARSED_ON_THE_LOOP_BYTES
    lone = chat_of(0).replace(b'"content": ""', b'"content": "%s\\ud800"' % pad.encode())
    refused = api.post(path, content=lone, headers=headers)
    assert refused.status_code == 400 and "lone surrogate" in refused.text
    deep = (
        b'{"model": "any", "pad": "'
        + pad.encode()
        + b'", "x": '
        + b"[" * 100_000
        + b"]" * 100_000
        + b"}"
    )
    refused = api.post(path, content=deep, headers=headers)
    assert refused.status_code == 400 and "nested too deep" in refused.text
    gate = api.app.state.backend.render_gate
    gate.admitted = gate.limit  # every place taken
    try:
        full = api.post(path, content=chat_of(PARSED_ON_THE_LOOP_BYTES), headers=headers)
    finally:
        gate.admitted = 0
    assert full.status_code == 429 and full.headers["retry-after"]
    body = full.json()
    if path == "/v1/messages":
        assert body["error"]["type"] == "rate_limit_error"
    else:
        assert body["error"]["code"] == "queue_full"
