"""POST /verify, the one request made every round, served without FastAPI's
per-request machinery (Starlette's middleware stack, dependency solving, a second
validation of the response, two encodings of it).

`VerifierAPI` is the FastAPI app with that one request taken off at the door: it goes
through the same request metrics and API-key guard as every route, then to a pure ASGI
handler. Validation is the same pydantic model; errors are the same bodies from
`server.errors`. The FastAPI route of the same path documents the endpoint in the
OpenAPI schema and runs the same `verify_round`.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from pydantic import ValidationError

from server.checks import routing_header, session_id_named
from server.errors import APIError, describe_validation, send_error, send_json
from server.metrics import RequestMetricsMiddleware
from server.paths import route_path
from server.protocol import SESSION_ID_HEADER, VerifyRequest, VerifyResponse
from server.security import ApiKeys, GuardMiddleware
from server.state import AppState, scheduler_of

PATH = "/verify"
ROUTING_HEADER = SESSION_ID_HEADER.lower().encode()
log = logging.getLogger(__name__)


async def verify_round(state: AppState, request: VerifyRequest, owner: str) -> VerifyResponse:
    """The round decoded, inline or in the next batch (see server/scheduler.py)."""
    return await scheduler_of(state).verify(request, owner)


def record_round(state: AppState, request: VerifyRequest, response: VerifyResponse) -> None:
    if response._counted:  # a duplicate's or a replay's answer: counted with its round
        return
    response._counted = True
    state.metrics.observe_round(len(request.draft_tokens), response.accepted_prefix_len)


class VerifierAPI(FastAPI):
    """The verifier's FastAPI app. Every HTTP request passes the request metrics, then the
    API-key guard; then POST /verify goes to `verify_lane` and the rest to Starlette's
    stack and the routes (a measurable share of a round's protocol overhead, see the
    README's Performance section)."""

    def __init__(self, *, keys: ApiKeys, max_body_bytes: int, **kwargs):
        super().__init__(**kwargs)
        self._front = RequestMetricsMiddleware(
            GuardMiddleware(self._dispatch, keys=keys, max_body_bytes=max_body_bytes)
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await super().__call__(scope, receive, send)
        scope["app"] = self  # the metrics find the app's state through it
        return await self._front(scope, receive, send)

    async def _dispatch(self, scope, receive, send):
        if route_path(scope) == PATH and scope["method"] == "POST":
            return await verify_lane(scope, receive, send)
        return await super().__call__(scope, receive, send)


async def verify_lane(scope, receive, send) -> None:
    scope["route_template"] = PATH  # for the request metrics
    body = await _read_body(receive)
    if body is None:
        return  # the client hung up before sending its request
    owner = scope.get("state", {}).get("key_id", "anonymous")
    try:
        state: AppState = scope["app"].state.verifier
        request = VerifyRequest.model_validate_json(body)
        session_id_named(routing_header(_headers(scope, ROUTING_HEADER)), request.session_id)
        response = await verify_round(state, request, owner)
    except ValidationError as exc:
        return await send_error(send, *describe_validation(exc.errors()))
    except APIError as exc:
        headers = [(k.lower().encode(), v.encode()) for k, v in (exc.headers or {}).items()]
        return await send_error(send, exc.status_code, exc.error_type, exc.message, headers)
    except Exception as exc:  # what the app's handler for the unexpected would answer
        log.exception("unexpected error in POST /verify")
        return await send_error(send, 500, "internal_error", f"{type(exc).__name__}: {exc}")
    await send_json(send, 200, response.model_dump_json().encode())
    record_round(state, request, response)  # after the answer is on its way


def _headers(scope, name: bytes) -> list[str]:
    return [value.decode("latin-1") for key, value in scope["headers"] if key == name]


async def _read_body(receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)
