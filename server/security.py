"""API keys and request size limits, enforced before any route runs.

Keys are compared in constant time as SHA-256 digests, against every configured key
with no early exit (vLLM's CVE-2025-59425 was a timing leak in its key check). What is
protected is decided on the request path alone, never on the Host header, and fails
closed: every path is protected except the explicitly open ones, unknown paths included.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path

from server.errors import send_error
from server.paths import route_path

OPEN_PATHS = frozenset({"/health"})
ANONYMOUS = "anonymous"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ApiKeys:
    def __init__(self, keys: Iterable[str]):
        self._digests = [_digest(k) for k in keys if k]

    @classmethod
    def from_settings(cls, keys: str, key_file: Path | None) -> ApiKeys:
        found = [k.strip() for k in keys.split(",")]
        if key_file is not None:
            found += [
                line.strip()
                for line in key_file.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")
            ]
        return cls(found)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def identify(self, presented: str | None) -> str | None:
        """The identity of a valid key ("key-N"), else None; constant time per key."""
        if not self.enabled:
            return ANONYMOUS
        if presented is None:
            return None
        digest = _digest(presented)
        match = None
        for index, known in enumerate(self._digests):
            if hmac.compare_digest(digest, known):
                match = index
        return None if match is None else f"key-{match}"


def presented_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        lower = name.lower()
        if lower == b"x-api-key":
            return value.decode("latin-1").strip()
        if lower == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


class GuardMiddleware:
    """Pure ASGI: rejects unauthenticated and oversized requests before the app sees them,
    and puts the caller's key identity in scope["state"]["key_id"]."""

    def __init__(self, app, *, keys: ApiKeys, max_body_bytes: int):
        self.app = app
        self.keys = keys
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = route_path(scope)
        if path in OPEN_PATHS:
            key_id = ANONYMOUS
        else:
            key_id = self.keys.identify(presented_key(scope["headers"]))
            if key_id is None:
                return await send_error(
                    send,
                    401,
                    "unauthorized",
                    "a valid API key is needed (Authorization: Bearer KEY or X-API-Key: KEY)",
                    [(b"www-authenticate", b"Bearer")],
                )
        scope.setdefault("state", {})["key_id"] = key_id
        for name, value in scope["headers"]:
            if name.lower() == b"content-length":
                try:
                    too_big = int(value) > self.max_body_bytes
                except ValueError:
                    return await send_error(send, 400, "invalid_request", "bad Content-Length")
                if too_big:
                    return await send_error(
                        send,
                        413,
                        "payload_too_large",
                        f"the body is over {self.max_body_bytes} bytes",
                    )
        has_length = any(name.lower() == b"content-length" for name, _ in scope["headers"])
        if has_length or scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS"):
            return await self.app(scope, receive, send)
        # No Content-Length (chunked): read up to the limit here, then hand the body on.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None  # the client went away
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return await send_error(
                    send, 413, "payload_too_large", f"the body is over {self.max_body_bytes} bytes"
                )
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
