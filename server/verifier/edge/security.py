"""API keys (server/shared/api_keys.py), checked before any route runs. What is
protected is decided on the request path alone, never on the Host header, and fails
closed: every path is protected except the explicitly open ones, unknown paths included.
"""

from __future__ import annotations

from server.shared.api_keys import ANONYMOUS, ApiKeys, presented_key
from server.verifier.errors import send_error
from server.verifier.paths import route_path

OPEN_PATHS = frozenset({"/health"})
# With keys on, only an admin key reads these: the metrics describe every key's traffic.
ADMIN_PATHS = frozenset({"/metrics"})


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
        key_id: str | None
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
