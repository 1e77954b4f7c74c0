"""Every error `serve` answers, mapped in this one place, in OpenAI's shape:
{"error": {"message", "type", "param", "code"}}; on the Messages API's paths in
Anthropic's: {"type": "error", "error": {"type", "message"}}. Unknown routes, bad JSON,
oversized bodies and anything unexpected included; no body is longer than a few hundred
bytes."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from drafter.errors import DrafterError, VerifierRejected, VerifierUnavailable, VocabularyMismatch
from drafter.serve.slots import QueueFull
from server.shared.request_body import NESTED_TOO_DEEP, UnreadableText, nested_too_deep

log = logging.getLogger("drafter.serve")

QUEUE_FULL_RETRY_AFTER_S = 2
MAX_MESSAGE_CHARS = 500
# Anthropic's error types by status (`api_error` for any other).
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def speaks_messages(path: str) -> bool:
    """Whether `path` is the Messages API's (its errors in Anthropic's shape)."""
    return path.removeprefix("/v1").startswith("/messages")


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    error_type = ANTHROPIC_ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": error_type, "message": message}}


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        error_type: str,
        code: str | None = None,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.error_type, self.code, self.param = status, error_type, code, param
        self.message = message if len(message) <= MAX_MESSAGE_CHARS else message[:497] + "..."
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def body_at(self, path: str) -> dict[str, Any]:
        """The body in the shape of the API at `path`."""
        return anthropic_error(self.status, self.message) if speaks_messages(path) else self.body()

    def response(self, path: str = "") -> JSONResponse:
        return JSONResponse(self.body_at(path), status_code=self.status, headers=self.headers)


async def send_openai_error(
    scope,
    send,
    status: int,
    code: str,
    message: str,
    headers: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    """The same error shapes from pure ASGI code (the body limit, the key guard)."""
    error_type = "invalid_request_error" if status < 500 else "server_error"
    error = OpenAIError(status, message, error_type, code)
    body = json.dumps(error.body_at(scope["path"])).encode()
    all_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        *headers,
    ]
    if status in (408, 413):
        all_headers.append((b"connection", b"close"))  # the rest of the body is not read
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body})


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", code, param=param)


class PromptTooLong(Exception):
    pass


def as_openai_error(exc: BaseException) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, PromptTooLong):
        return invalid_request(str(exc), "messages", "context_length_exceeded")
    if isinstance(exc, QueueFull):
        retry = {"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)}
        return OpenAIError(429, str(exc), "rate_limit_error", "queue_full", headers=retry)
    if isinstance(exc, VocabularyMismatch):
        return OpenAIError(502, str(exc), "verifier_error", "vocabulary_mismatch")
    if isinstance(exc, VerifierUnavailable):
        return OpenAIError(503, str(exc), "verifier_error", "verifier_unavailable")
    if isinstance(exc, VerifierRejected):
        if exc.status == 401:
            return OpenAIError(
                502,
                "the verifier refused this server's API key (the key `serve` sends to the "
                "verifier, not yours): start `draft_token_generator serve` with --api-key "
                "or DRAFTER_API_KEY set to a key the verifier accepts",
                "verifier_error",
                "verifier_unauthorized",
            )
        if exc.status == 413:  # a prompt the verifier's context cannot hold: the user's to fix
            return invalid_request(exc.message, "prompt", "context_length_exceeded")
        if exc.status == 400 or exc.status == 422:
            return invalid_request(exc.message, code=exc.error_type)
        status = exc.status if exc.status in (409, 503) else 502
        return OpenAIError(status, exc.message, "verifier_error", exc.error_type)
    if isinstance(exc, DrafterError):
        return OpenAIError(500, str(exc), "server_error", "drafter_error")
    log.error("unexpected error", exc_info=exc)
    return OpenAIError(500, f"{type(exc).__name__}: {exc}", "server_error", "internal_error")


def describe_validation(errors: Sequence[dict[str, Any]]) -> OpenAIError:
    """The first problem only, its field named: a request with a million bad values gets
    one short answer."""
    if not errors:
        return invalid_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return invalid_request("the request body is not valid JSON", code="invalid_json")
    loc = [p for p in first.get("loc", ()) if p != "body"]
    where = ".".join(str(p) for p in loc if not _tag(p))
    message = first.get("msg", "invalid")
    if any(_tag(p) for p in loc):  # a field of several forms: the first form's complaint
        message = f"not any form this field takes (as the first: {message})"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return invalid_request(f"{where}: {message}{more}", param=where or None)


def _tag(part: object) -> bool:
    """A part of a pydantic location that names which type of a union failed
    (`function-after[...]`, `list[TextPart]`, `str`), not a field: left out of `param`."""
    return isinstance(part, str) and (
        not part.isidentifier() or part in {"str", "int", "float", "bool", "list", "dict"}
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return describe_validation(exc.errors()).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI answers a body its reader refused with a bare 400: read_json's refusals,
        # and the route's validation where the body was read (drafter/serve/routes.py).
        if isinstance(invalid := exc.__cause__, RequestValidationError):
            error = describe_validation(invalid.errors())
        elif nested_too_deep(exc):
            error = invalid_request(NESTED_TOO_DEEP, code="invalid_json")
        elif isinstance(unreadable := exc.__cause__, UnreadableText):
            error = invalid_request(str(unreadable), param=unreadable.where, code="invalid_json")
        elif isinstance(exc.__cause__, QueueFull):  # too many bodies being parsed at once
            error = as_openai_error(exc.__cause__)
        elif exc.status_code == 404:
            error = OpenAIError(
                404, f"no route {request.url.path}", "invalid_request_error", "not_found"
            )
        elif exc.status_code == 405:
            error = OpenAIError(
                405,
                f"{request.method} is not allowed on {request.url.path}",
                "invalid_request_error",
                "method_not_allowed",
            )
        else:
            error = OpenAIError(exc.status_code, str(exc.detail), "invalid_request_error")
        return error.response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return as_openai_error(exc).response(request.url.path)
