"""A request body read whole, within a size and a time limit, before an app sees it.

Pure ASGI (no web framework imported), so the verifier and `serve` share it. A body over
`max_bytes` is refused as soon as its Content-Length says so, or while it arrives
(chunked); one that trickles in slower than `timeout_s` is refused with 408 and the
connection closed, so a client cannot hold the server with a half-sent body. How an
error is written is the app's own (each server has its error shape): `reject`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

Send = Callable[[dict[str, Any]], Awaitable[None]]
# reject(scope, send, status, code, message): write the error response (in the shape of
# the API at scope's path).
Reject = Callable[[dict[str, Any], Send, int, str, str], Awaitable[None]]

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
NESTED_TOO_DEEP = "the request body is nested too deep to read as JSON"


def nested_too_deep(exc: BaseException) -> bool:
    """Whether a web framework's refusal of a body it could not parse came of JSON nested
    deeper than the parser recurses: malformed JSON to the client, not some other fault
    (FastAPI answers every parse failure but a syntax error with one bare 400)."""
    return isinstance(exc.__cause__, RecursionError)


class ClientGone(Exception):
    """The client closed the connection before its body was in."""


async def read_body(receive: Callable[[], Awaitable[dict]], max_bytes: int) -> bytes | None:
    """The whole body, or None once it grows past `max_bytes`; ClientGone if the client
    hangs up."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class BodyLimit:
    def __init__(self, app, *, max_bytes: int, timeout_s: float, reject: Reject):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.reject = reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            return await self.app(scope, receive, send)
        too_large = f"the body is over {self.max_bytes} bytes"
        for name, value in scope["headers"]:
            if name.lower() == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await self.reject(
                        scope, send, 400, "invalid_request", "bad Content-Length"
                    )
                if declared > self.max_bytes:
                    return await self.reject(scope, send, 413, "payload_too_large", too_large)
        try:
            # From the headers on: a client that sends headers and never a byte of its
            # body is held to the same limit as one that trickles it.
            async with asyncio.timeout(self.timeout_s):
                body = await read_body(receive, self.max_bytes)
        except TimeoutError:
            scope.setdefault("state", {})["body_timeout"] = True
            return await self.reject(
                scope,
                send,
                408,
                "request_timeout",
                f"the body did not arrive in {self.timeout_s:g} s",
            )
        except ClientGone:
            scope.setdefault("state", {})["client_gone"] = True
            return None
        if body is None:
            return await self.reject(scope, send, 413, "payload_too_large", too_large)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        return await self.app(scope, replay, send)
