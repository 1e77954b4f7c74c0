"""POST /verify, the one request of every round: its answer, and a short path to it.

`VerifyFastPath` is a pure ASGI step that answers POST /verify after the request metrics,
the API-key guard and the body limit have seen it, and before Starlette's routing,
exception middleware and FastAPI's request handling: the same validation, the same
errors (server/verifier/errors.py), the same metrics, the same service call as the route
(routes/sessions.py). It is on by default because it is
measured to pay (`scripts/bench_overhead.py`, docs/performance.md); with
VERIFIER_VERIFY_FAST_PATH=false the route answers.
"""

from __future__ import annotations

import logging

from pydantic import ValidationError

from server.shared.protocol import SESSION_ID_HEADER, VerifyRequest
from server.shared.request_body import read_json
from server.verifier.edge.state import AppState, service_of
from server.verifier.errors import (
    APIError,
    describe_validation,
    send_error,
    send_json,
    unreadable_body,
)
from server.verifier.paths import route_path

log = logging.getLogger(__name__)

PATH = "/verify"
ROUTING_HEADER = SESSION_ID_HEADER.lower().encode()


def json_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether FastAPI would read the body as JSON: no Content-Type, or application/json
    or application/*+json."""
    for name, value in headers:
        if name == b"content-type":
            kind = value.split(b";", 1)[0].strip().lower()
            return kind == b"application/json" or (
                kind.startswith(b"application/") and kind.endswith(b"+json")
            )
    return True


def verify_request(body: bytes) -> VerifyRequest:
    """The body read by pydantic's own JSON parser, which is quick; where that refuses
    it, read as the route reads it (`read_json`, then the same validation), so that every
    body, JSON or not, is answered as the route answers it."""
    try:
        return VerifyRequest.model_validate_json(body)
    except ValidationError as exc:
        if not any(e.get("type") == "json_invalid" for e in exc.errors()):
            raise
    return VerifyRequest.model_validate(read_json(body))


class VerifyFastPath:
    """Pure ASGI: POST /verify answered here, everything else passed on."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or route_path(scope) != PATH
            or not json_body(scope["headers"])
        ):
            return await self.app(scope, receive, send)  # the route answers as it would
        scope["route"] = self
        message = await receive()  # the body limit has read it whole: one message
        if message["type"] != "http.request":
            return None  # the client hung up
        state: AppState = scope["app"].state.verifier
        owner = scope.get("state", {}).get("key_id", "anonymous")
        routing = [v.decode("latin-1") for k, v in scope["headers"] if k == ROUTING_HEADER]
        body = message.get("body", b"")
        try:
            if not body:  # what FastAPI says of a missing body
                raise ValidationError.from_exception_data(
                    "VerifyRequest", [{"type": "missing", "loc": ("body",), "input": None}]
                )
            request = verify_request(body)
        except ValidationError as exc:
            return await send_error(send, *describe_validation(exc.errors(), VerifyRequest))
        except (ValueError, RecursionError) as exc:  # read_json's refusals
            return await send_error(send, *unreadable_body(exc))
        try:
            response = await service_of(state).verify(request, owner, routing)
        except ValidationError as exc:
            return await send_error(send, *describe_validation(exc.errors(), VerifyRequest))
        except APIError as exc:
            headers = [(k.lower().encode(), v.encode()) for k, v in (exc.headers or {}).items()]
            return await send_error(send, exc.status_code, exc.error_type, exc.message, headers)
        except Exception as exc:  # what the app's handler for the unexpected answers
            log.exception("unexpected error in POST /verify")
            return await send_error(send, 500, "internal_error", f"{type(exc).__name__}: {exc}")
        await send_json(send, 200, response.model_dump_json().encode())

    @property
    def path(self) -> str:
        """The route the request metrics label its requests with."""
        return PATH
