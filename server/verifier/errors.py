"""Every error the verifier returns, and the one place they become HTTP responses.

All of them share one body: {"error": {"code", "type", "message"}} (docs/protocol.md).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.shared.protocol import GenerateRequest, PrefillRequest, VerifyRequest
from server.shared.request_body import NESTED_TOO_DEEP, UnreadableText, nested_too_deep
from server.shared.strict import did_you_mean, fields_at
from server.verifier.paths import route_path

# The body's model of each route that reads one: an unknown field is named against it.
BODY_MODELS = {"/prefill": PrefillRequest, "/verify": VerifyRequest, "/generate": GenerateRequest}

log = logging.getLogger(__name__)


class APIError(Exception):
    status_code = 400
    error_type = "invalid_request"

    def __init__(self, message: str, *, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.headers = headers


class SessionNotFound(APIError):
    status_code = 404
    error_type = "session_not_found"


class NPastMismatch(APIError):
    status_code = 409
    error_type = "n_past_mismatch"


class SessionBusy(APIError):
    """A guard: the scheduler never lets two rounds (or a round and a delete) of one
    session meet in the engine."""

    status_code = 409
    error_type = "session_busy"


class SessionExists(APIError):
    status_code = 409
    error_type = "session_exists"


class SessionIdMismatch(APIError):
    error_type = "session_id_mismatch"


class InvalidToken(APIError):
    error_type = "invalid_token"


class InvalidGrammar(APIError):
    error_type = "invalid_grammar"


class DraftTooLong(APIError):
    error_type = "draft_too_long"


class ContextOverflow(APIError):
    error_type = "context_overflow"


class GrammarTokenLimit(APIError):
    """A round of a session that has generated the tokens its grammar may generate, where
    the verifier cannot prove the grammar ends (VERIFIER_GRAMMAR_UNPROVEN_TOKENS)."""

    error_type = "grammar_token_limit"


class PromptTooLong(APIError):
    """A prompt text longer than any that can fit a session's context: refused before it
    is tokenized."""

    status_code = 413
    error_type = "prompt_too_long"


class EmptyPrompt(APIError):
    error_type = "empty_prompt"


class InvalidDraftProbs(APIError):
    error_type = "invalid_draft_probs"


class UnsupportedSampling(APIError):
    error_type = "unsupported_sampling"


class Unavailable(APIError):
    """503 with Retry-After: nothing was done, and sending the request again is safe."""

    status_code = 503

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class ModelNotReady(Unavailable):
    error_type = "model_loading"

    def __init__(self, message: str = "the model is still loading"):
        super().__init__(message)


class ModelFailed(Unavailable):
    """The model did not load (the verifier runs on, told to wait for it): no client
    should wait for a restart that is not coming."""

    error_type = "model_failed"


class ServerFull(Unavailable):
    error_type = "server_full"


class EngineInterrupted(Unavailable):
    """The engine's pass broke before this job was done; the job was undone, so sending it
    again is safe (a round already answered is replayed)."""

    error_type = "engine_interrupted"


class DecodeFailed(APIError):
    """llama_decode refused this job even alone: retrying will not help."""

    status_code = 500
    error_type = "decode_failed"


class NonFiniteNumbers(APIError):
    """The model's numbers for a round are not finite: the round is undone, never judged."""

    status_code = 500
    error_type = "non_finite_numbers"


class InternalError(APIError):
    status_code = 500
    error_type = "internal_error"


def error_body(status_code: int, error_type: str, message: str) -> dict:
    return {"error": {"code": status_code, "type": error_type, "message": message}}


def error_response(
    status_code: int, error_type: str, message: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        error_body(status_code, error_type, message), status_code=status_code, headers=headers
    )


async def send_error(
    send,
    status_code: int,
    error_type: str,
    message: str,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    """The same error, from pure ASGI code (the guard, the /verify lane)."""
    # Rendered as JSONResponse renders: one format, whichever layer answers.
    body = json.dumps(
        error_body(status_code, error_type, message), ensure_ascii=False, separators=(",", ":")
    ).encode()
    await send_json(send, status_code, body, headers)


async def send_json(
    send, status_code: int, body: bytes, headers: Iterable[tuple[bytes, bytes]] = ()
) -> None:
    start_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status_code, "headers": start_headers})
    await send({"type": "http.response.body", "body": body})


NOT_JSON = "the request body is not valid JSON"


def unreadable_body(exc: BaseException) -> tuple[int, str, str]:
    """(status, type, message) for a body `read_json` refused: what every path answers."""
    if isinstance(exc, UnreadableText):
        return 400, "malformed_json", str(exc)
    if isinstance(exc, RecursionError):
        return 400, "malformed_json", NESTED_TOO_DEEP
    return 400, "malformed_json", NOT_JSON


# pydantic words some errors one way for a JSON body (the fast path) and another for the
# Python objects FastAPI validates: one wording, so both paths answer alike.
SAME_WORDS = {
    "model_type": "Input should be an object",
    "model_attributes_type": "Input should be an object",
    "dict_type": "Input should be an object",
    "list_type": "Input should be an array",
    "tuple_type": "Input should be an array",
}


def describe_validation(
    errors: Sequence[Mapping[str, Any]], model: type | None = None
) -> tuple[int, str, str]:
    """(status, type, message) for pydantic's errors, as FastAPI or the fast path found
    them; `model`: the body's model, whose fields an unknown field is compared with."""
    invalid = [e for e in errors if e.get("type") == "json_invalid"]
    if invalid:
        # pydantic's own parser (the /verify fast path) stops at a depth of its own.
        if "recursion limit" in str(invalid[0].get("ctx", {}).get("error", "")):
            return 400, "malformed_json", NESTED_TOO_DEEP
        return 400, "malformed_json", NOT_JSON
    unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        path = [p for p in unknown[0].get("loc", ()) if p != "body"]
        known = fields_at(model, path[:-1]) if model is not None and path else []
        where = ".".join(str(p) for p in path)
        return 400, "unknown_field", f"unknown field {where!r}" + did_you_mean(str(path[-1]), known)
    parts = []
    for e in errors[:5]:
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {SAME_WORDS.get(e.get('type', ''), e.get('msg', 'invalid'))}")
    return 422, "invalid_request", "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status_code, exc.error_type, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        model = BODY_MODELS.get(route_path(request.scope))
        return error_response(*describe_validation(exc.errors(), model))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI answers a body its reader (read_json) refused with a bare 400.
        cause = exc.__cause__
        if cause is not None and (nested_too_deep(exc) or isinstance(cause, UnreadableText)):
            return error_response(*unreadable_body(cause))
        error_type = {404: "not_found", 405: "method_not_allowed"}.get(
            exc.status_code, "http_error"
        )
        return error_response(exc.status_code, error_type, str(exc.detail), exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, "internal_error", f"{type(exc).__name__}: {exc}")
