"""HTTP client of the verifier: wire models in, wire models out, bytes counted.

urllib3 carries the requests: keep-alive, TLS, proxies (`HTTPS_PROXY`, `NO_PROXY`), a
balancer in the path and retries with backoff are its well-trodden ground. What it costs
per round is measured by `scripts/bench_overhead.py` (docs/performance.md), and is small
beside a round's decode.
"""

from __future__ import annotations

import ipaddress
import json
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
    InvalidHeader,
    MaxRetryError,
    NewConnectionError,
    ProxySchemeUnknown,
    SSLError,
    TimeoutError,
)
from urllib3.util.retry import Retry

from drafter.errors import VerifierRejected, VerifierUnavailable
from server.shared.protocol import (
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
# Full, loading, or a balancer between us and a verifier that is restarting. A 500 is a
# failure the verifier says will not go away (decode_failed, internal_error): not retried.
RETRY_STATUSES = frozenset({502, 503, 504})
BACKOFF_FACTOR_S = 0.2
BACKOFF_JITTER_S = 0.2
# Also the most a server's Retry-After can make us wait between two tries.
BACKOFF_CEILING_S = 5.0
MAX_VOCAB_FILE_BYTES = 64 << 20


class CountedRetry(Retry):
    """urllib3's Retry, telling its owner each time it waits to try again, and waiting
    no longer than BACKOFF_CEILING_S whatever a Retry-After says.

    urllib3 copies a Retry at every step (`new`); the callback goes with the copies.
    """

    on_retry: Callable[[], None] | None = None

    def new(self, **kw) -> CountedRetry:
        retry = super().new(**kw)
        retry.on_retry = self.on_retry
        return retry

    def sleep(self, response=None) -> None:
        if self.on_retry is not None:
            self.on_retry()
        super().sleep(response)

    def get_retry_after(self, response) -> float | None:
        # A server's Retry-After is honoured, up to the longest backoff of our own; one
        # urllib3 cannot read ("0.5") leaves the wait to our backoff.
        try:
            seconds = super().get_retry_after(response)
        except InvalidHeader:
            return None
        return None if seconds is None else min(seconds, BACKOFF_CEILING_S)

    def is_retry(self, method: str, status_code: int, has_retry_after: bool = False) -> bool:
        # Only RETRY_STATUSES: urllib3 would also retry a 413 or 429 carrying Retry-After.
        return super().is_retry(method, status_code, has_retry_after=False)

    def increment(self, method=None, url=None, response=None, error=None, **kw) -> CountedRetry:
        # A certificate the CA does not vouch for will not get better by trying again;
        # every other failure to connect or read (a TLS handshake cut off, a proxy that
        # cannot reach a restarting verifier yet) may.
        if isinstance(error, SSLError) and (
            self.connect == 0  # never reached yet: https to an http verifier, say
            or any(isinstance(arg, ssl.SSLCertVerificationError) for arg in error.args)
        ):
            raise error
        return super().increment(method, url, response, error, **kw)


def retry_policy(
    max_retries: int, on_retry: Callable[[], None] | None = None, connect: int | None = None
) -> CountedRetry:
    """Every method is retried, POST included: a replayed /verify gets its recorded answer,
    a replayed /prefill of a chosen id a 409 the loop resolves, a lost session a 404 the
    loop recovers from. A refused certificate is not (CountedRetry.increment); `connect`
    caps the retries of a connection that could not be made."""
    retry = CountedRetry(
        total=max_retries,
        connect=connect,
        redirect=False,
        allowed_methods=None,
        status_forcelist=RETRY_STATUSES,
        raise_on_status=False,  # the last 5xx's body says what went wrong
        respect_retry_after_header=True,
        backoff_factor=BACKOFF_FACTOR_S,
        backoff_jitter=BACKOFF_JITTER_S,
        backoff_max=BACKOFF_CEILING_S,
    )
    retry.on_retry = on_retry
    return retry


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
    ):
        self.base_url = base_url.rstrip("/")
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
        # Until the verifier has answered once, a refused connection or an unknown host
        # is a mistake to report at once (a wrong URL, a verifier not started), not an
        # outage to wait out; a 503 (still loading) is waited for either way.
        self._retry_unproven = retry_policy(max_retries, self._counted_retry, connect=0)
        self.reached = False
        self.retries_done = 0
        self.bytes_sent = 0
        self.bytes_received = 0

    def _counted_retry(self) -> None:
        self.retries_done += 1

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
            raise self._unreachable(exc.reason, self.retries_done - retries_before) from exc
        except HTTPError as exc:  # not retried (max_retries=0, or a certificate refused)
            raise self._unreachable(exc, self.retries_done - retries_before) from exc
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
