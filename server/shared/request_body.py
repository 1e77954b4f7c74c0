"""A request body read whole, within a size and a time limit, before an app sees it.

Pure ASGI (no web framework imported), so the verifier and `serve` share it. A body over
`max_bytes` is refused as soon as its Content-Length says so, or while it arrives
(chunked); one that trickles in slower than `timeout_s` is refused with 408 and the
connection closed, so a client cannot hold the server with a half-sent body. How an
error is written is the app's own (each server has its error shape): `reject`. The cap
may be a function of the request (`BodyCap`): what a body to that path can use.

`read_json` is how both servers read a JSON body once it is in: UTF-8 only, and no
string in it that UTF-8 cannot encode.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

# ASGI's shapes, as Starlette spells them (starlette.types), without importing it.
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
# reject(scope, send, status, code, message): write the error response (in the shape of
# the API at scope's path).
Reject = Callable[[Scope, Send, int, str, str], Awaitable[None]]
# A body's cap for the request at scope, and why it is that (a phrase the 413 ends with,
# or ""): asked before the body is read.
BodyCap = Callable[[Scope], tuple[int, str]]

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
NESTED_TOO_DEEP = "the request body is nested too deep to read as JSON"


def nested_too_deep(exc: BaseException) -> bool:
    """Whether a web framework's refusal of a body it could not parse came of JSON nested
    deeper than the parser recurses: malformed JSON to the client, not some other fault
    (FastAPI answers every parse failure but a syntax error with one bare 400)."""
    return isinstance(exc.__cause__, RecursionError)


class UnreadableText(ValueError):
    """A JSON body whose text is not Unicode: bytes that are not UTF-8, or a string (a key
    or a value) holding a lone surrogate, which JSON's `\\u` escapes can spell and no UTF-8
    can carry. Refused where the body is read, before any work: such a string fails
    wherever it is written out again (a tokenizer, a serializer, a grammar compiler), deep
    inside the request's work. `path`: where it is (keys and indices), () for the bytes."""

    def __init__(self, message: str, path: tuple[str | int, ...] = ()):
        super().__init__(message)
        self.path = path

    @property
    def where(self) -> str | None:
        return ".".join(map(_printable, self.path)) or None


# The only way a lone surrogate gets into text decoded as UTF-8 (which refuses their
# bytes): a \u escape. Text without one is not walked.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def read_json(body: bytes) -> Any:
    """A JSON body as both servers read it (RFC 8259's UTF-8, RFC 7493's strings): json's
    parse of the UTF-8 text, refused (UnreadableText) where a string holds a lone
    surrogate. json.loads alone would take UTF-16 and UTF-32 too, and a surrogate's bytes.
    Raises json.JSONDecodeError for what is not JSON, RecursionError for what nests deeper
    than json's parser recurses."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnreadableText(f"the request body is not UTF-8 (byte {exc.start})") from None
    value = json.loads(text)
    if _SURROGATE_ESCAPE.search(text) is not None:
        path = unencodable_path(value)
        if path is not None:
            where = ".".join(map(_printable, path)) or "the body"
            raise UnreadableText(
                f"{where}: not Unicode text (a lone surrogate, which UTF-8 cannot encode)", path
            )
    return value


def unencodable_path(value: Any) -> tuple[str | int, ...] | None:
    """Where a parsed JSON value holds a string (a key or a value) that UTF-8 cannot
    encode, or None. Walked without recursing, since a body may nest as deep as json's
    parser goes; only containers are kept on the way, each with its parent's link."""
    if isinstance(value, str):
        return () if _SURROGATE.search(value) else None
    if not isinstance(value, (dict, list)):
        return None
    todo: list[tuple[Any, Any]] = [(value, None)]  # (container, (parent link, key) or None)
    while todo:
        node, link = todo.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if (isinstance(key, str) and _SURROGATE.search(key)) or (
                isinstance(child, str) and _SURROGATE.search(child)
            ):
                path: list[str | int] = [key]
                while link is not None:
                    link, parent_key = link
                    path.append(parent_key)
                return tuple(reversed(path))
            if isinstance(child, (dict, list)):
                todo.append((child, (link, key)))
    return None


def _printable(part: str | int) -> str:
    """A path's part as a message may carry it: a lone surrogate in a key escaped."""
    return str(part).encode("utf-8", "backslashreplace").decode("utf-8")


class ClientGone(Exception):
    """The client closed the connection before its body was in."""


async def read_body(receive: Receive, max_bytes: int) -> bytes | None:
    """The whole body, or None once it grows past `max_bytes`; ClientGone if the client
    hangs up."""
    chunks: list[bytes] = []
    size = 0
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
    def __init__(self, app: ASGIApp, *, max_bytes: int | BodyCap, timeout_s: float, reject: Reject):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.reject = reject

    def cap(self, scope: Scope) -> tuple[int, str]:
        return self.max_bytes(scope) if callable(self.max_bytes) else (self.max_bytes, "")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            return await self.app(scope, receive, send)
        max_bytes, why = self.cap(scope)
        too_large = f"the body is over {max_bytes} bytes" + (f", {why}" if why else "")
        for name, value in scope["headers"]:
            if name.lower() == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await self.reject(
                        scope, send, 400, "invalid_request", "bad Content-Length"
                    )
                if declared > max_bytes:
                    return await self.reject(scope, send, 413, "payload_too_large", too_large)
        try:
            # From the headers on: a client that sends headers and never a byte of its
            # body is held to the same limit as one that trickles it.
            async with asyncio.timeout(self.timeout_s):
                body = await read_body(receive, max_bytes)
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

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        return await self.app(scope, replay, send)
