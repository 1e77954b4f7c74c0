"""The API-key guard on its own (pure ASGI): which path needs which key."""

from __future__ import annotations

import asyncio

import pytest

from server.verifier.edge.security import ApiKeys, GuardMiddleware
from server.verifier.paths import route_path


async def ok(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def status(guard: GuardMiddleware, path: str, key: str | None = None, root_path: str = "") -> int:
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    scope = {"type": "http", "method": "GET", "path": path, "root_path": root_path}
    scope["headers"] = headers
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    asyncio.run(guard(scope, receive, send))
    return sent[0]["status"]


def test_admin_keys_alone_close_the_metrics_and_nothing_else():
    guard = GuardMiddleware(ok, keys=ApiKeys([]), admin_keys=ApiKeys(["admin-key"]))
    assert status(guard, "/metrics") == 403
    assert status(guard, "/metrics", "admin-key") == 200
    assert status(guard, "/info") == 200  # no API keys: the rest stays open


@pytest.mark.parametrize(
    ("path", "root_path", "expected"),
    [
        ("/verify", "", "/verify"),
        ("/m/verify", "/m", "/verify"),
        ("/metrics", "/m", "/metrics"),  # /m is not a segment of /metrics: nothing cut
        ("/m", "/m", ""),
    ],
)
def test_the_root_path_is_cut_where_starlettes_router_cuts_it(path, root_path, expected):
    assert route_path({"path": path, "root_path": root_path}) == expected


def test_a_root_path_that_is_not_a_segment_does_not_hide_the_metrics():
    guard = GuardMiddleware(ok, keys=ApiKeys(["user-key"]), admin_keys=ApiKeys(["admin-key"]))
    assert status(guard, "/metrics", "user-key", root_path="/m") == 403
    assert status(guard, "/m/metrics", "user-key", root_path="/m") == 403
    assert status(guard, "/m/info", "user-key", root_path="/m") == 200
