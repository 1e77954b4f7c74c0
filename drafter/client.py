"""HTTP client of the verifier: wire models in, wire models out, bytes counted.

urllib3 carries the requests: keep-alive, TLS, proxies (`HTTPS_PROXY`, `NO_PROXY`), a
balancer in the path and retries with backoff are its well-trodden ground. What it costs
per round is measured by `scripts/bench_overhead.py` (docs/performance.md), and is small
beside a round's decode.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import ssl
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote, urlsplit

import urllib3
from pydantic import BaseModel, ValidationError
from urllib3.exceptions import (
    HTTPError,
    MaxRetryError,
    NewConnectionError,
    ProxySchemeUnknown,
    SSLError,
    TimeoutError,
)

from drafter.errors import VerifierRejected, VerifierUnavailable
from drafter.retry import RestartWait, loading, retry_policy, speaks_tls
from server.shared.info import InfoResponse
from server.shared.protocol import (
    SESSION_ID,
    SESSION_ID_HEADER,
    GenerateRequest,
    GenerateResponse,
    PrefillRequest,
    PrefillResponse,
    VerifyRequest,
    VerifyResponse,
)

R = TypeVar("R", bound=BaseModel)
log = logging.getLogger(__name__)

USER_AGENT = "draft_token_generator/0.1"
MAX_VOCAB_FILE_BYTES = 64 << 20


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def proxy_for(url: str) -> str | None:
    """The proxy the environment names for this URL (`HTTPS_PROXY`, `HTTP_PROXY`,
    `NO_PROXY`, as curl and requests read them); a verifier on loopback never has one."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if is_loopback(host) or urllib.request.proxy_bypass(host):
        return None
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and "://" not in proxy:
        proxy = f"http://{proxy}"  # curl's reading of `proxy.corp:3128`
    return proxy


class VerifierClient:
    """Keep-alive connections to the verifier (one, unless used from several threads).

    `bytes_sent` and `bytes_received` count HTTP/1.1 bytes as framed: start line, the
    headers the client sets or receives, and the body; not TCP or TLS overhead.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 60.0,
        max_retries: int = 6,
        api_key: str | None = None,
        ca_cert: str | Path | None = None,
        restart_wait_s: float = 0.0,
    ):
        """`restart_wait_s`: how long to wait out a verifier that is restarting (its
        connections refused after it had answered, or 503 while it loads its model)
        before giving up, beyond the `max_retries` of any failure."""
        self.base_url, self.ca_cert = base_url.rstrip("/"), ca_cert
        self.restart_wait_s = restart_wait_s
        url = urlsplit(self.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise VerifierUnavailable(f"not an http(s):// verifier URL: {base_url!r}")
        # All the headers the request will carry, so that the byte counts are exact.
        self._headers = {
            "Host": url.netloc,
            "User-Agent": USER_AGENT,
            "Accept-Encoding": "identity",
        }
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        # Certificates are always verified; --ca-cert adds a private CA (self-signed servers).
        context = (
            ssl.create_default_context(cafile=str(ca_cert) if ca_cert else None)
            if url.scheme == "https"
            else None
        )
        pool_args = {"maxsize": 1, "timeout": timeout, "ssl_context": context}
        proxy = proxy_for(self.base_url)
        try:
            self._http = (
                urllib3.ProxyManager(proxy, **pool_args)
                if proxy
                else urllib3.PoolManager(**pool_args)
            )
        except ProxySchemeUnknown as exc:
            raise VerifierUnavailable(
                f"the proxy the environment names for {self.base_url} ({proxy}) is not an "
                "http:// or https:// proxy, the only kinds this drafter speaks"
            ) from exc
        # urllib3 never changes a Retry, it makes new ones: one serves every request.
        self._retry = retry_policy(max_retries, self._counted_retry)
        # Until the verifier has answered once, a refused connection, an unknown host or
        # http:// to a TLS port is a mistake to report at once (a wrong URL, a verifier
        # not started), not an outage to wait out; a 503 (still loading) is waited for
        # either way.
        self._retry_unproven = retry_policy(max_retries, self._counted_retry, connect=0)
        self._retry_unproven.speaks_tls = self._speaks_tls
        self._tls: bool | None = None
        self.reached = False
        # Whether whoever waits for the answer has gone (serve's client hung up): a
        # restart is then not waited out.
        self.abandoned: Callable[[], bool] = lambda: False
        self.retries_done = 0
        self.bytes_sent = 0
        self.bytes_received = 0

    def _counted_retry(self) -> None:
        self.retries_done += 1

    def _speaks_tls(self) -> bool:
        if self._tls is None:
            self._tls = speaks_tls(self.base_url)
        return self._tls

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

    def vocab_file(self) -> bytes:
        """The verifier's vocabulary as a vocabulary-only GGUF (GET /vocab), refused past
        MAX_VOCAB_FILE_BYTES: a tokenizer is a few MB, never a model's weights."""
        response = self._request("GET", "/vocab", None, None, preload=False)
        try:
            data = response.read(MAX_VOCAB_FILE_BYTES + 1)
        finally:
            response.release_conn()
        self.bytes_received += len(data)
        if len(data) > MAX_VOCAB_FILE_BYTES:
            raise VerifierUnavailable(
                f"the verifier's vocabulary file is over {MAX_VOCAB_FILE_BYTES >> 20} MiB"
            )
        return data

    def close(self) -> None:
        self._http.clear()

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
    ) -> R | None:
        response = self._request(method, path, body, session_id)
        if response_type is None:
            return None
        try:
            return response_type.model_validate_json(response.data)
        except ValidationError as exc:
            raise VerifierUnavailable(
                f"the verifier at {self.base_url} sent a {path} response this drafter does "
                f"not understand: {exc.errors()[0]['msg']}"
            ) from exc

    def _request(
        self,
        method: str,
        path: str,
        body: BaseModel | None,
        session_id: str | None,
        preload: bool = True,
    ) -> urllib3.BaseHTTPResponse:
        """The verifier's answer, retried as the policy says; 4xx and 5xx raise.
        `session_id` goes in the X-Session-Id header too: a balancer routes by it."""
        content = body.model_dump_json(exclude_none=True).encode() if body is not None else None
        headers = dict(self._headers)
        if session_id is not None:
            if not SESSION_ID.fullmatch(session_id):
                raise VerifierUnavailable(f"not a session id: {session_id!r}")  # nor a header
            headers[SESSION_ID_HEADER] = session_id
        if content is not None:
            headers["Content-Type"] = "application/json"
            headers["Content-Length"] = str(len(content))
        url = self.base_url + path
        retries_before = self.retries_done
        restart = RestartWait(self.base_url, self.restart_wait_s, self.abandoned)
        while True:
            try:
                response = self._http.urlopen(
                    method,
                    url,
                    body=content,
                    headers=headers,
                    retries=self._retry if self.reached else self._retry_unproven,
                    redirect=False,
                    preload_content=preload,
                )
            except MaxRetryError as exc:
                # Refused, once it had answered: a restart. (An answer cut off is not: a
                # live verifier or proxy may have cut it, and the retries cover it.)
                refused = isinstance(exc.reason, NewConnectionError)
                if self.reached and refused and restart.goes_on("its connections are refused"):
                    continue
                raise self._unreachable(exc.reason, self.retries_done - retries_before) from exc
            except HTTPError as exc:  # not retried (max_retries=0, or a certificate refused)
                raise self._unreachable(exc, self.retries_done - retries_before) from exc
            if not (loading(response) and restart.goes_on("it is loading its model")):
                break
        self.reached = True
        self.bytes_sent += framed_request_bytes(method, urlsplit(url).path, headers, content)
        # A streamed body (preload off) is counted by whoever reads it.
        self.bytes_received += framed_response_bytes(response, len(response.data) if preload else 0)
        if response.status >= 400:
            raise _rejection(response.status, response.reason or "", response.data)
        return response

    def _unreachable(self, reason: BaseException | None, retries: int) -> VerifierUnavailable:
        if isinstance(reason, SSLError):
            what = "failed the TLS handshake"
        elif isinstance(reason, TimeoutError) and not isinstance(reason, NewConnectionError):
            what = "timed out"  # (refused connections are urllib3 connect timeouts too)
        else:
            what = "cannot be reached"
        hint = ""
        if not self.reached and isinstance(reason, NewConnectionError):
            hint = " Is the verifier running there (and is the URL's scheme, host and port right)?"
        elif not self.reached and "WRONG_VERSION_NUMBER" in str(reason):
            hint = " Does the verifier speak plain http:// rather than https://?"
        elif not self.reached and self.base_url.startswith("http:") and self._speaks_tls():
            hint = " The verifier speaks TLS there: use https://."
        elif "CERTIFICATE_VERIFY_FAILED" in str(reason) and not self.ca_cert:
            hint = (
                " Its certificate is not signed by a CA this machine trusts: for a private "
                "CA, give its certificate with --ca-cert ca.pem (DRAFTER_CA_CERT); "
                "./scripts/make_certs.sh makes one."
            )
        tries = f" after {retries + 1} tries" if retries else ""
        return VerifierUnavailable(
            f"the verifier at {self.base_url} {what}{tries} (cannot reach the verifier: "
            f"{_short(reason)}).{hint}"
        )


def _short(reason: BaseException | None) -> str:
    """urllib3's reason without its object reprs: the part a person reads."""
    text = str(reason)
    return text.split(": ", 1)[1] if text.startswith("<") and ": " in text else text


def framed_request_bytes(
    method: str, path: str, headers: dict[str, str], content: bytes | None
) -> int:
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return len(head.encode("latin-1")) + 2 + len(content or b"")


def framed_response_bytes(response: urllib3.BaseHTTPResponse, body_bytes: int) -> int:
    start = f"HTTP/1.1 {response.status} {response.reason or ''}\r\n"
    head = start + "".join(f"{k}: {v}\r\n" for k, v in response.headers.items())
    return len(head.encode("latin-1")) + 2 + body_bytes


def _rejection(status: int, reason: str, body: bytes) -> VerifierRejected:
    try:
        error = json.loads(body)["error"]
        return VerifierRejected(status, error["type"], error["message"])
    except (ValueError, KeyError, TypeError):
        text = body[:200].decode("utf-8", "replace") or reason
        return VerifierRejected(status, "http_error", text)
