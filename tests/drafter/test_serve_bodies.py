"""How large a body `serve` takes, decided before it is read: a Content-Length over the cap
is a 413 in the API's own shape with not a byte of the body asked for, a chunked body is
refused as soon as it passes the cap, and a body within it is answered as before. Once
the verifier's context is known the cap is what a request could use with it. A large
body is parsed on the render gate's threads, under its bound. No verifier is needed:
the app is called as ASGI, or its generations are scripted."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest

import drafter.serve.body_bounds as body_bounds
from drafter.serve.app import create_app
from drafter.serve.body_bounds import OTHER_FIELDS_BYTES, PARSED_ON_THE_LOOP_BYTES, BodyBounds
from drafter.settings import DrafterSettings
from server.shared.request_body import read_json
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
        bounds.learn(0, 0)


def test_a_large_body_is_parsed_on_the_render_gates_threads(scripted, monkeypatch):
    serve, api = scripted
    serve.answer = "Fine."
    threads: list[str] = []

    def recorded(body: bytes) -> Any:
        threads.append(threading.current_thread().name)
        return read_json(body)

    monkeypatch.setattr(body_bounds, "read_json", recorded)
    small, large = chat_of(10), chat_of(PARSED_ON_THE_LOOP_BYTES)
    for body in (small, large):
        answered = api.post(
            "/v1/messages", content=body, headers={"content-type": "application/json"}
        )
        assert answered.status_code == 200, answered.text
    assert not threads[0].startswith("render") and threads[1].startswith("render")


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
