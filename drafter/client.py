"""HTTP client of the verifier: wire models in, wire models out, bytes counted."""

from __future__ import annotations

import random
import ssl
import time
from pathlib import Path
from typing import TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from drafter.errors import VerifierRejected, VerifierUnavailable
from server.protocol import (
    GenerateRequest,
    GenerateResponse,
    InfoResponse,
    PrefillRequest,
    PrefillResponse,
    VerifyRequest,
    VerifyResponse,
)

R = TypeVar("R", bound=BaseModel)

USER_AGENT = "draft_token_generator/0.1"
RETRY_STATUSES = frozenset({500, 502, 503, 504})


def _header_bytes(headers: httpx.Headers) -> int:
    return sum(len(k) + len(v) + 4 for k, v in headers.raw)  # "k: v\r\n"


class VerifierClient:
    """One keep-alive connection to the verifier.

    `bytes_sent` and `bytes_received` count HTTP/1.1 bytes as written on the wire (start
    line, headers, body), not TCP or TLS overhead.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 60.0,
        transport: httpx.BaseTransport | None = None,
        max_retries: int = 6,
        api_key: str | None = None,
        ca_cert: str | Path | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        headers = {"user-agent": USER_AGENT}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        # Certificates are always verified; --ca-cert adds a private CA (self-signed servers).
        verify: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=str(ca_cert)) if ca_cert else True
        )
        self._http = httpx.Client(
            base_url=self.base_url,
            timeout=timeout,
            transport=transport,
            headers=headers,
            verify=verify,
        )
        self.retries_done = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.max_retries = max_retries

    def _pause(self, attempt: int, retry_after: str | None) -> None:
        self.retries_done += 1
        time.sleep(backoff_s(attempt, retry_after))

    def info(self) -> InfoResponse:
        return self._call("GET", "/info", None, InfoResponse)

    def prefill(self, request: PrefillRequest) -> PrefillResponse:
        return self._call("POST", "/prefill", request, PrefillResponse)

    def verify(self, request: VerifyRequest) -> VerifyResponse:
        return self._call("POST", "/verify", request, VerifyResponse)

    def generate(self, request: GenerateRequest) -> GenerateResponse:
        return self._call("POST", "/generate", request, GenerateResponse)

    def delete_session(self, session_id: str) -> None:
        self._call("DELETE", f"/sessions/{session_id}", None, None)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> VerifierClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self,
        method: str,
        path: str,
        body: BaseModel | None,
        response_type: type[R] | None,
        attempt: int = 0,
    ) -> R | None:
        content = body.model_dump_json(exclude_none=True).encode() if body is not None else None
        headers = {"content-type": "application/json"} if content is not None else None
        try:
            request = self._http.build_request(method, path, content=content, headers=headers)
            response = self._http.send(request)
        except httpx.TransportError as exc:
            # Lost on the way, or the verifier is restarting. Retrying is safe: a replayed
            # /verify gets its recorded answer, a lost session a 404 the loop recovers from.
            if attempt < self.max_retries:
                self._pause(attempt, None)
                return self._call(method, path, body, response_type, attempt + 1)
            what = "timed out" if isinstance(exc, httpx.TimeoutException) else "cannot be reached"
            raise VerifierUnavailable(
                f"the verifier at {self.base_url} {what} after {attempt + 1} tries "
                f"(cannot reach the verifier: {exc})"
            ) from exc
        self.bytes_sent += (
            len(f"{method} {path} HTTP/1.1\r\n")
            + _header_bytes(request.headers)
            + 2
            + len(content or b"")
        )
        self.bytes_received += (
            len(f"HTTP/1.1 {response.status_code} {response.reason_phrase}\r\n")
            + _header_bytes(response.headers)
            + 2
            + len(response.content)
        )
        if response.status_code in RETRY_STATUSES and attempt < self.max_retries:
            # Full, loading or failing: the round was not committed, so sending it again
            # is safe.
            self._pause(attempt, response.headers.get("retry-after"))
            return self._call(method, path, body, response_type, attempt + 1)
        if response.status_code >= 400:
            raise _rejection(response)
        if response_type is None:
            return None
        try:
            return response_type.model_validate_json(response.content)
        except ValidationError as exc:
            raise VerifierUnavailable(
                f"the verifier at {self.base_url} sent a {path} response this drafter does "
                f"not understand: {exc.errors()[0]['msg']}"
            ) from exc


def backoff_s(attempt: int, retry_after: str | None, ceiling_s: float = 5.0) -> float:
    """Retry-After when the server gave one, else exponential backoff with full jitter."""
    if retry_after is not None:
        try:
            return min(max(float(retry_after), 0.05), ceiling_s)
        except ValueError:
            pass
    return random.uniform(0.5, 1.5) * min(0.2 * 2**attempt, ceiling_s)


def _rejection(response: httpx.Response) -> VerifierRejected:
    try:
        error = response.json()["error"]
        return VerifierRejected(response.status_code, error["type"], error["message"])
    except (ValueError, KeyError, TypeError):
        text = response.text[:200] or response.reason_phrase
        return VerifierRejected(response.status_code, "http_error", text)
