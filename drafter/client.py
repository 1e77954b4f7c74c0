"""HTTP client of the verifier: wire models in, wire models out, bytes counted.

One keep-alive HTTP/1.1 connection through the standard library's `http.client`: a round
is one small JSON request, and httpx's request and response layers cost about 0.7 ms a
request here (measured against http.client and a raw socket on loopback), most of the
protocol overhead budget of a round.
"""

from __future__ import annotations

import http.client
import json
import random
import ssl
import time
from pathlib import Path
from typing import NamedTuple, TypeVar
from urllib.parse import urlsplit

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
# A kept-alive connection the server has since closed fails on first use; that is not a
# lost request, so it is sent once more on a new connection at once.
STALE_CONNECTION = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


class Reply(NamedTuple):
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name), None)


def _header_bytes(headers: list[tuple[str, str]]) -> int:
    return sum(len(k) + len(v) + 4 for k, v in headers)  # "k: v\r\n"


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
        self._headers = [("Host", url.netloc), ("User-Agent", USER_AGENT)]
        if api_key:
            self._headers.append(("Authorization", f"Bearer {api_key}"))
        # Certificates are always verified; --ca-cert adds a private CA (self-signed servers).
        self._ssl = (
            ssl.create_default_context(cafile=str(ca_cert) if ca_cert else None)
            if self._https
            else None
        )
        self._conn: http.client.HTTPConnection | None = None
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
        if self._conn is not None:
            self._conn.close()
            self._conn = None

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
        try:
            reply = self._exchange(method, path, content)
        except (OSError, http.client.HTTPException) as exc:
            # Lost on the way, or the verifier is restarting. Retrying is safe: a replayed
            # /verify gets its recorded answer, a lost session a 404 the loop recovers from.
            # A certificate the CA does not vouch for will not get better by retrying.
            retryable = not isinstance(exc, ssl.SSLCertVerificationError)
            if retryable and attempt < self.max_retries:
                self._pause(attempt, None)
                return self._call(method, path, body, response_type, attempt + 1)
            what = "timed out" if isinstance(exc, TimeoutError) else "cannot be reached"
            raise VerifierUnavailable(
                f"the verifier at {self.base_url} {what} after {attempt + 1} tries "
                f"(cannot reach the verifier: {exc})"
            ) from exc
        if reply.status in RETRY_STATUSES and attempt < self.max_retries:
            # Full, loading or failing: the round was not committed, so sending it again
            # is safe.
            self._pause(attempt, reply.header("retry-after"))
            return self._call(method, path, body, response_type, attempt + 1)
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

    def _exchange(self, method: str, path: str, content: bytes | None) -> Reply:
        reused = self._conn is not None
        try:
            return self._send(method, path, content)
        except STALE_CONNECTION:
            self.close()
            if not reused:
                raise
        except BaseException:
            self.close()
            raise
        try:  # once more, on a new connection
            return self._send(method, path, content)
        except BaseException:
            self.close()
            raise

    def _send(self, method: str, path: str, content: bytes | None) -> Reply:
        if self._conn is None:
            self._conn = (
                http.client.HTTPSConnection(
                    self._host, self._port, timeout=self._timeout, context=self._ssl
                )
                if self._https
                else http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
            )
        conn = self._conn
        target = self._prefix + path
        headers = list(self._headers)
        if content is not None:
            headers += [("Content-Type", "application/json"), ("Content-Length", str(len(content)))]
        conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
        for name, value in headers:
            conn.putheader(name, value)
        conn.endheaders(content)
        response = conn.getresponse()
        reply = Reply(response.status, response.reason, response.getheaders(), response.read())
        if response.will_close:
            self.close()
        self.bytes_sent += (
            len(f"{method} {target} HTTP/1.1\r\n")
            + _header_bytes(headers)
            + 2
            + len(content or b"")
        )
        self.bytes_received += (
            len(f"HTTP/1.1 {reply.status} {reply.reason}\r\n")
            + _header_bytes(reply.headers)
            + 2
            + len(reply.body)
        )
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
