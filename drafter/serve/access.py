"""Who may call `serve`: its own API key (`--serve-api-key`, not the verifier's), checked
before a body is read, and the browser origins allowed to call it (CORS, Starlette's
middleware). /health stays open, for load balancers and probes."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

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
        if self.keys.identify(presented) is None:
            message = (
                "no API key given: send Authorization: Bearer KEY (the OpenAI client's "
                "api_key) with the key `serve` was started with"
                if presented is None
                else "incorrect API key provided"
            )
            headers = [(b"www-authenticate", b"Bearer")]
            return await send_openai_error(scope, send, 401, "invalid_api_key", message, headers)
        return await self.app(scope, receive, send)


def add_access(app: FastAPI, settings: DrafterSettings) -> None:
    """The key guard, then CORS outside it (added last: Starlette runs it first)."""
    if settings.serve_api_key:
        app.add_middleware(ClientKeyGuard, keys=ApiKeys([settings.serve_api_key]))
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            max_age=600,
        )
