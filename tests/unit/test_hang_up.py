"""A client that hangs up before its answer: counted and logged as 499, never as the
status of the answer nobody received."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from server.verifier.hang_up import HangUpWatch
from server.verifier.metrics import RequestMetricsMiddleware, VerifierMetrics

BODY = {"type": "http.request", "body": b"{}", "more_body": False}
DISCONNECT = {"type": "http.disconnect"}


def scope_of(metrics: VerifierMetrics) -> dict:
    app = SimpleNamespace(state=SimpleNamespace(verifier=SimpleNamespace(metrics=metrics)))
    return {
        "type": "http",
        "method": "POST",
        "path": "/verify",
        "root_path": "",
        "query_string": b"",
        "headers": [],
        "http_version": "1.1",
        "client": ("127.0.0.1", 50000),
        "app": app,
    }


def server_receive(hang_up: asyncio.Event):
    """What uvicorn's receive does: the body, then (blocking) the disconnect."""
    messages = iter([BODY])

    async def receive() -> dict:
        message = next(messages, None)
        if message is not None:
            return message
        await hang_up.wait()
        return DISCONNECT

    return receive


def answering_app(before_answer=None):
    """An app that reads its body, optionally awaits something, then answers 200."""

    async def app(scope, receive, send):
        scope["route"] = SimpleNamespace(path="/verify")
        assert (await receive())["type"] == "http.request"
        if before_answer is not None:
            await before_answer(receive)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    return app


def counted(metrics: VerifierMetrics, status: str) -> float:
    return metrics.requests.labels("/verify", status)._value.get()


def run(app, hang_up_first: bool, caplog) -> tuple[VerifierMetrics, list[dict]]:
    metrics = VerifierMetrics()
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def main():
        hang_up = asyncio.Event()
        if hang_up_first:
            hang_up.set()
        await RequestMetricsMiddleware(app)(scope_of(metrics), server_receive(hang_up), send)

    with caplog.at_level(logging.INFO, logger="uvicorn.access"):
        asyncio.run(main())
    return metrics, sent


def test_an_answer_to_a_client_that_hung_up_is_counted_and_logged_499(caplog):
    async def wait_for_the_hang_up(receive):
        # The round goes on after the client has gone (here: until the app sees it).
        assert (await receive())["type"] == "http.disconnect"

    metrics, sent = run(answering_app(wait_for_the_hang_up), True, caplog)
    assert counted(metrics, "499") == 1 and counted(metrics, "200") == 0
    assert sent[0]["status"] == 200  # the server drops it; the count says what happened
    lines = [r.getMessage() for r in caplog.records if r.name == "uvicorn.access"]
    assert lines == ['127.0.0.1:50000 - "POST /verify HTTP/1.1" 499']


def test_an_answer_to_a_client_still_there_is_counted_as_sent(caplog):
    metrics, _ = run(answering_app(), False, caplog)
    assert counted(metrics, "200") == 1 and counted(metrics, "499") == 0
    assert not [r for r in caplog.records if r.name == "uvicorn.access"]


def test_a_client_gone_before_its_body_is_499_with_nothing_sent(caplog):
    async def app(scope, receive, send):
        scope["route"] = SimpleNamespace(path="/verify")
        await receive()  # the body limit reads, finds the client gone, answers nothing

    metrics = VerifierMetrics()

    async def main():
        async def receive():
            return DISCONNECT

        async def send(message):
            raise AssertionError("nothing is sent")

        await RequestMetricsMiddleware(app)(scope_of(metrics), receive, send)

    with caplog.at_level(logging.INFO, logger="uvicorn.access"):
        asyncio.run(main())
    assert counted(metrics, "499") == 1


def test_the_watch_answers_every_later_receive_with_one_listening_call():
    calls = []

    async def main():
        hang_up = asyncio.Event()
        inner = server_receive(hang_up)

        async def receive():
            calls.append(1)
            return await inner()

        watch = HangUpWatch(receive)
        assert await watch.receive() == BODY
        assert not watch.gone
        hang_up.set()
        assert await watch.receive() == DISCONNECT
        assert await watch.receive() == DISCONNECT
        assert watch.gone
        watch.close()

    asyncio.run(main())
    assert len(calls) == 2  # the body, and the one listening call
