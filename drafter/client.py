"""HTTP client of the verifier: wire models in, wire models out, bytes counted.

One keep-alive HTTP/1.1 connection (`drafter/http1.py`): a round is one small JSON
request, and both httpx and `http.client` spend a good part of a round's protocol budget
on their request and response layers (measured against a raw socket on loopback).
"""

from __future__ import annotations

import json
import random
import ssl
import time
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote, urlsplit

from pydantic import BaseModel, ValidationError

from drafter.errors import VerifierRejected, VerifierUnavailable
from drafter.http1 import Connection, Reply, StaleConnection, header_lines
from server.protocol import (
    SESSION_ID,
    SESSION_ID_HEADER,
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
ROUTING_LINE = SESSION_ID_HEADER.encode() + b": %s\r\n"
JSON_BODY_HEADERS = b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
# Full, loading, or a balancer between us and a verifier that is restarting. A 500 is a
# failure the verifier says will not go away (decode_failed, internal_error): not retried.
RETRY_STATUSES = frozenset({502, 503, 504})
# A kept-alive connection the server has since closed fails on first use; that is not a
# lost request, so it is sent once more on a new connection at once.
STALE_CONNECTION = (StaleConnection, ConnectionResetError, BrokenPipeError)


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
        max_retries: int = 6,
        api_key: str | None = None,
        ca_cert: str | Path | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        url = urlsplit(self.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise VerifierUnavailable(f"not an http(s):// verifier URL: {base_url!r}")
        self._https = url.scheme == "https"
        self._host = url.hostname
        self._port = url.port or (443 if self._https else 80)
        self._prefix = url.path.rstrip("/")
        self._timeout = timeout
        headers = [("Host", url.netloc), ("User-Agent", USER_AGENT)]
        if api_key:
            headers.append(("Authorization", f"Bearer {api_key}"))
        self._header_lines = header_lines(headers)  # the same on every request
        # Certificates are always verified; --ca-cert adds a private CA (self-signed servers).
        self._ssl = (
            ssl.create_default_context(cafile=str(ca_cert) if ca_cert else None)
            if self._https
            else None
        )
        self._conn = Connection(self._host, self._port, timeout=timeout, ssl_context=self._ssl)
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
        return self._call("POST", "/prefill", request, PrefillResponse, request.session_id)

    def verify(self, request: VerifyRequest) -> VerifyResponse:
        return self._call("POST", "/verify", request, VerifyResponse, request.session_id)

    def generate(self, request: GenerateRequest) -> GenerateResponse:
        return self._call("POST", "/generate", request, GenerateResponse)

    def delete_session(self, session_id: str) -> None:
        self._call("DELETE", f"/sessions/{quote(session_id, safe='')}", None, None, session_id)

    def close(self) -> None:
        self._conn.close()

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
        session_id: str | None = None,
        attempt: int = 0,
    ) -> R | None:
        """`session_id` goes in the X-Session-Id header too: a balancer routes by it."""
        content = body.model_dump_json(exclude_none=True).encode() if body is not None else None
        if session_id is not None and not SESSION_ID.fullmatch(session_id):
            raise VerifierUnavailable(f"not a session id: {session_id!r}")  # nor a header
        routing = b"" if session_id is None else ROUTING_LINE % session_id.encode()
        try:
            reply = self._exchange(method, path, content, routing)
        except OSError as exc:
            # Lost on the way, or the verifier is restarting. Retrying is safe: a replayed
            # /verify gets its recorded answer, a lost session a 404 the loop recovers from.
            # A certificate the CA does not vouch for will not get better by retrying.
            retryable = not isinstance(exc, ssl.SSLCertVerificationError)
            if retryable and attempt < self.max_retries:
                self._pause(attempt, None)
                return self._call(method, path, body, response_type, session_id, attempt + 1)
            what = "timed out" if isinstance(exc, TimeoutError) else "cannot be reached"
            raise VerifierUnavailable(
                f"the verifier at {self.base_url} {what} after {attempt + 1} tries "
                f"(cannot reach the verifier: {exc})"
            ) from exc
        if reply.status in RETRY_STATUSES and attempt < self.max_retries:
            # The round was not committed, so sending it again is safe.
            self._pause(attempt, reply.header("retry-after"))
            return self._call(method, path, body, response_type, session_id, attempt + 1)
        if reply.status >= 400:
            raise _rejection(reply)
        if response_type is None:
            return None
        try:
            return response_type.model_validate_json(reply.body)
        except ValidationError as exc:
            raise VerifierUnavailable(
                f"the verifier at {self.base_url} sent a {path} response this drafter does "
                f"not understand: {exc.errors()[0]['msg']}"
            ) from exc

    def _exchange(self, method: str, path: str, content: bytes | None, extra: bytes) -> Reply:
        reused = self._conn.is_open
        try:
            return self._send(method, path, content, extra)
        except STALE_CONNECTION:
            if not reused:
                raise
        return self._send(method, path, content, extra)  # once more, on a new connection

    def _send(self, method: str, path: str, content: bytes | None, extra: bytes) -> Reply:
        message = f"{method} {self._prefix}{path} HTTP/1.1\r\n".encode() + self._header_lines
        message += extra
        if content is None:
            message += b"\r\n"
        else:
            message += JSON_BODY_HEADERS % len(content) + content
        reply = self._conn.request(message, head_only=method == "HEAD")
        self.bytes_sent += len(message)
        self.bytes_received += reply.wire_bytes
        return reply


def backoff_s(attempt: int, retry_after: str | None, ceiling_s: float = 5.0) -> float:
    """Retry-After when the server gave one, else exponential backoff with full jitter."""
    if retry_after is not None:
        try:
            return min(max(float(retry_after), 0.05), ceiling_s)
        except ValueError:
            pass
    return random.uniform(0.5, 1.5) * min(0.2 * 2**attempt, ceiling_s)


def _rejection(reply: Reply) -> VerifierRejected:
    try:
        error = json.loads(reply.body)["error"]
        return VerifierRejected(reply.status, error["type"], error["message"])
    except (ValueError, KeyError, TypeError):
        text = reply.body[:200].decode("utf-8", "replace") or reply.reason
        return VerifierRejected(reply.status, "http_error", text)
