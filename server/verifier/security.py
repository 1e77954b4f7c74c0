"""API keys, checked before any route runs.

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

from server.verifier.errors import send_error
from server.verifier.paths import route_path

OPEN_PATHS = frozenset({"/health"})
# With keys on, only an admin key reads these: the metrics describe every key's traffic.
ADMIN_PATHS = frozenset({"/metrics"})
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

    def __len__(self) -> int:
        return len(self._digests)

    def identify(self, presented: str | None, prefix: str = "key") -> str | None:
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
        return None if match is None else f"{prefix}-{match}"


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
    """Pure ASGI: rejects unauthenticated requests before the app sees them, and puts the
    caller's key identity in scope["state"]["key_id"]."""

    def __init__(self, app, *, keys: ApiKeys, admin_keys: ApiKeys | None = None):
        self.app = app
        self.keys = keys
        self.admin_keys = admin_keys or ApiKeys([])

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = route_path(scope)
        presented = presented_key(scope["headers"])
        admin = self.admin_keys.enabled and self.admin_keys.identify(presented, "admin")
        if path in OPEN_PATHS:
            key_id = ANONYMOUS
        else:
            key_id = admin or self.keys.identify(presented)
            if key_id is None:
                return await send_error(
                    send,
                    401,
                    "unauthorized",
                    "a valid API key is needed (Authorization: Bearer KEY or X-API-Key: KEY)",
                    [(b"www-authenticate", b"Bearer")],
                )
            if path in ADMIN_PATHS and (self.keys.enabled or self.admin_keys.enabled) and not admin:
                return await send_error(
                    send,
                    403,
                    "forbidden",
                    f"{path} needs an admin key (VERIFIER_ADMIN_API_KEYS) when keys are on",
                )
        scope.setdefault("state", {})["key_id"] = key_id
        return await self.app(scope, receive, send)
