"""Who may call `serve`: its own API keys (`--serve-api-key`, `--serve-api-key-file`, not
the verifier's), checked before a body is read, and the browser origins allowed to call it
(CORS, Starlette's middleware). /health stays open, for load balancers and probes. The
identity of the key a request presented (never the key) goes with the request: whose
history it may be drafted from (drafter/principals.py)."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from drafter.principals import PRINCIPAL, client_keys
from drafter.serve.errors import send_openai_error
from drafter.settings import DrafterSettings
from server.shared.api_keys import ApiKeys, presented_key

OPEN_PATHS = frozenset({"/health"})


class ClientKeyGuard:
    """Pure ASGI: a request without the key gets OpenAI's 401 before the app sees it."""

    def __init__(self, app, *, keys: ApiKeys):
        self.app = app
        self.keys = keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        presented = presented_key(scope["headers"])
        identity = self.keys.identify(presented)
        if identity is None:
            message = (
                "no API key given: send Authorization: Bearer KEY (the OpenAI client's "
                "api_key) with the key `serve` was started with"
                if presented is None
                else "incorrect API key provided"
            )
            headers = [(b"www-authenticate", b"Bearer")]
            return await send_openai_error(scope, send, 401, "invalid_api_key", message, headers)
        scope[PRINCIPAL] = identity
        return await self.app(scope, receive, send)


def add_access(app: FastAPI, settings: DrafterSettings) -> None:
    """The key guard, then CORS outside it (added last: Starlette runs it first)."""
    keys = client_keys(settings)
    if keys.enabled:
        app.add_middleware(ClientKeyGuard, keys=keys)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            max_age=600,
        )
