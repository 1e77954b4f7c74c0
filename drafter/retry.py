"""When and how the verifier's client tries again: urllib3's Retry with a ceiling on the
waits and a count of them, a TLS port told apart before first contact, and the wait for a
verifier that restarts."""

from __future__ import annotations

import json
import logging
import socket
import ssl
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import urllib3
from urllib3.exceptions import InvalidHeader, ProtocolError, SSLError
from urllib3.util.retry import Retry

log = logging.getLogger(__name__)

# Full, loading, or a balancer between us and a verifier that is restarting. A 500 is a
# failure the verifier says will not go away (decode_failed, internal_error): not retried.
RETRY_STATUSES = frozenset({502, 503, 504})
BACKOFF_FACTOR_S = 0.2
BACKOFF_JITTER_S = 0.2
# Also the most a server's Retry-After can make us wait between two tries.
BACKOFF_CEILING_S = 5.0


class CountedRetry(Retry):
    """urllib3's Retry, telling its owner each time it waits to try again, and waiting
    no longer than BACKOFF_CEILING_S whatever a Retry-After says.

    urllib3 copies a Retry at every step (`new`); the callback goes with the copies.
    """

    on_retry: Callable[[], None] | None = None
    # Before first contact: whether the port speaks TLS to a plain http:// request.
    speaks_tls: Callable[[], bool] | None = None

    def new(self, **kw) -> CountedRetry:
        retry = super().new(**kw)
        retry.on_retry, retry.speaks_tls = self.on_retry, self.speaks_tls
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
        # A connection closed unanswered by a TLS port will be closed again: said at once.
        if isinstance(error, ProtocolError) and self.speaks_tls and self.speaks_tls():
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


class RestartWait:
    """Waiting out a verifier that restarts: a few seconds between tries, one log line
    when the wait begins, and at most `limit_s` in all; over as soon as `abandoned()`
    says nobody waits for the answer any more."""

    PAUSE_S = 1.0

    def __init__(self, url: str, limit_s: float, abandoned: Callable[[], bool] = lambda: False):
        self.url = url
        self.limit_s = limit_s
        self.abandoned = abandoned
        self.began: float | None = None

    def goes_on(self, why: str) -> bool:
        """Whether to try again (after a pause); False once the wait is over."""
        if self.abandoned():
            return False
        now = time.monotonic()
        if self.began is None:
            if self.limit_s <= 0:
                return False
            self.began = now
            log.warning(
                "the verifier at %s is restarting (%s): waiting up to %.0f s for it "
                "(--restart-wait)",
                self.url,
                why,
                self.limit_s,
            )
        if now - self.began >= self.limit_s:
            return False
        time.sleep(min(self.PAUSE_S, self.limit_s - (now - self.began)))
        return True


def speaks_tls(url: str, timeout_s: float = 2.0) -> bool:
    """Whether an http:// URL's port completes a TLS handshake (certificate unchecked:
    this only decides what to tell the user)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        return False
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    address = (parts.hostname, parts.port or 80)
    try:
        with (
            socket.create_connection(address, timeout=timeout_s) as plain,
            context.wrap_socket(plain, server_hostname=parts.hostname),
        ):
            return True
    except (OSError, ssl.SSLError):
        return False


def loading(response: urllib3.BaseHTTPResponse) -> bool:
    """A 503 `model_loading`: a verifier (re)starting. Its body is read only then."""
    if response.status != 503:
        return False
    try:
        return json.loads(response.data)["error"]["type"] == "model_loading"
    except (ValueError, KeyError, TypeError):
        return False
