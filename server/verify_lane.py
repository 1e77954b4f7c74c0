"""POST /verify, the one request made every round, served without FastAPI's
per-request machinery (dependency solving, a second validation of the response, two
encodings of it).

A pure ASGI layer between the API-key guard and the app: auth, body limits and request
metrics apply as for every route; validation is the same pydantic model; errors are the
same bodies from `server.errors`. The FastAPI route of the same path documents the
endpoint in the OpenAPI schema and runs the same `verify_round`.
"""

from __future__ import annotations

from pydantic import ValidationError

from server.errors import APIError, describe_validation, send_error, send_json
from server.protocol import VerifyRequest, VerifyResponse
from server.state import AppState, scheduler_of

PATH = "/verify"


async def verify_round(state: AppState, request: VerifyRequest, owner: str) -> VerifyResponse:
    """Queue the round for the next batch; record its metrics."""
    scheduler = scheduler_of(state)
    response = await scheduler.verify(request, owner)
    state.metrics.observe_round(len(request.draft_tokens), response.accepted_prefix_len)
    return response


class VerifyLane:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != PATH or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        scope["route_template"] = PATH  # for the request metrics
        body = await _read_body(receive)
        if body is None:
            return None  # the client hung up before sending its request
        state: AppState = scope["app"].state.verifier
        owner = scope.get("state", {}).get("key_id", "anonymous")
        try:
            request = VerifyRequest.model_validate_json(body)
            response = await verify_round(state, request, owner)
        except ValidationError as exc:
            return await send_error(send, *describe_validation(exc.errors()))
        except APIError as exc:
            headers = [(k.lower().encode(), v.encode()) for k, v in (exc.headers or {}).items()]
            return await send_error(send, exc.status_code, exc.error_type, exc.message, headers)
        await send_json(send, 200, response.model_dump_json().encode())


async def _read_body(receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)
