"""The drafter's verifier client against a scripted server on 127.0.0.1: keep-alive,
retries and their limits, Retry-After, proxies, headers and exact byte counts."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from drafter.client import VerifierClient
from drafter.errors import VerifierRejected, VerifierUnavailable
from drafter.retry import RestartWait
from server.shared.protocol import PrefillRequest, RoundTimings, VerifyRequest, VerifyResponse

OK_JSON = b'{"status":"ok"}'


def content_length(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
        % (len(body), extra, body)
    )


class ScriptedServer:
    """Answers each request with the next reply from `replies`; a reply is bytes, or a
    callable given the connection (to close it, split writes, ...). Records requests and
    the connection each came on."""

    def __init__(self, replies: list[bytes | Callable[[socket.socket], None]]):
        self.replies = list(replies)
        self.requests: list[tuple[int, bytes]] = []
        self.connections = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while self.replies:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                self._converse(conn, self.connections)

    def _converse(self, conn: socket.socket, number: int) -> None:
        buffer = b""
        while self.replies:
            while b"\r\n\r\n" not in buffer:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                buffer += chunk
            head, _, rest = buffer.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            while len(rest) < length:
                rest += conn.recv(65536)
            self.requests.append((number, head + b"\r\n\r\n" + rest[:length]))
            buffer = rest[length:]
            reply = self.replies.pop(0)
            if callable(reply):
                reply(conn)
                if conn.fileno() == -1:
                    return
            else:
                conn.sendall(reply)

    def close(self) -> None:
        self.replies.clear()
        self.listener.close()


@pytest.fixture
def scripted() -> Iterator[Callable[..., ScriptedServer]]:
    servers: list[ScriptedServer] = []

    def start(*replies) -> ScriptedServer:
        servers.append(ScriptedServer(list(replies)))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


SESSION = "a" * 32


def error_reply(status: int, reason: str, error_type: str, extra: bytes = b"") -> bytes:
    body = b'{"error":{"code":%d,"type":"%s","message":"said so"}}' % (status, error_type.encode())
    return b"HTTP/1.1 %d %s\r\ncontent-length: %d\r\n%s\r\n%s" % (
        status,
        reason.encode(),
        len(body),
        extra,
        body,
    )


def hang_up(conn: socket.socket) -> None:
    conn.close()


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    """The waits urllib3's Retry asks for, recorded instead of slept."""
    import time
    import types

    import urllib3.util.retry as retry_module

    waited: list[float] = []
    fake_time = types.SimpleNamespace(sleep=waited.append, time=time.time)
    monkeypatch.setattr(retry_module, "time", fake_time)
    return waited


def client_of(server: ScriptedServer, path: str = "", **kwargs) -> VerifierClient:
    return VerifierClient(f"http://127.0.0.1:{server.port}{path}", **kwargs)


VERIFY_ANSWER = (
    VerifyResponse(
        accepted_prefix_len=1,
        tokens=[7, 8],
        preds=[7, 8],
        total_tokens=7,
        eos=False,
        strategy="greedy",
        lossless=True,
        timings=RoundTimings(decode_ms=1.0, decoded_tokens=2),
    )
    .model_dump_json()
    .encode()
)


def test_one_kept_alive_connection_carries_every_request_and_counts_its_bytes(scripted):
    replies = [content_length(OK_JSON), error_reply(404, "Not Found", "session_not_found")]
    server = scripted(*replies)
    client = client_of(server, "/base", api_key="k")
    client._call("GET", "/health", None, None)
    request = PrefillRequest(prompt="hi", session_id=SESSION)
    with pytest.raises(VerifierRejected) as rejected:
        client.prefill(request)
    assert (rejected.value.status, rejected.value.error_type) == (404, "session_not_found")
    assert server.connections == 1
    (_, health), (_, prefill) = server.requests
    assert prefill.startswith(b"POST /base/prefill HTTP/1.1\r\n")
    for header in (b"Authorization: Bearer k", b"X-Session-Id: " + SESSION.encode()):
        assert b"\r\n" + header + b"\r\n" in prefill
    assert b"X-Session-Id" not in health
    assert prefill.endswith(b"\r\n\r\n" + request.model_dump_json(exclude_none=True).encode())
    assert client.bytes_sent == len(health) + len(prefill)
    assert client.bytes_received == sum(len(reply) for reply in replies)


def test_retry_after_is_honoured_up_to_a_ceiling(scripted, sleeps):
    server = scripted(
        error_reply(503, "Service Unavailable", "server_busy", b"Retry-After: 2\r\n"),
        error_reply(503, "Service Unavailable", "server_busy", b"Retry-After: 3600\r\n"),
        content_length(OK_JSON),
    )
    client = client_of(server)
    client._call("GET", "/health", None, None)
    assert sleeps == [2, 5.0]
    assert client.retries_done == 2
    assert len(server.requests) == 3


def test_only_the_retry_statuses_are_retried_whatever_retry_after_says(scripted, sleeps):
    server = scripted(error_reply(429, "Too Many Requests", "rate_limited", b"Retry-After: 1\r\n"))
    with pytest.raises(VerifierRejected) as rejected:
        client_of(server)._call("GET", "/health", None, None)
    assert rejected.value.status == 429 and len(server.requests) == 1 and sleeps == []


def test_a_retry_after_urllib3_cannot_read_leaves_the_wait_to_the_backoff(scripted, sleeps):
    server = scripted(
        error_reply(503, "Service Unavailable", "server_busy", b"Retry-After: 0.5\r\n"),
        content_length(OK_JSON),
    )
    client = client_of(server)
    client._call("GET", "/health", None, None)
    assert client.retries_done == 1 and len(server.requests) == 2


def test_5xx_from_a_balancer_backs_off_with_jitter_then_gives_the_last_answer(scripted, sleeps):
    server = scripted(*[error_reply(502, "Bad Gateway", "bad_gateway")] * 4)
    client = client_of(server, max_retries=3)
    with pytest.raises(VerifierRejected) as rejected:
        client.verify(VerifyRequest(session_id=SESSION, n_past=5))
    assert rejected.value.status == 502
    assert len(server.requests) == 4
    assert client.retries_done == 3
    # The first retry goes at once (a connection dropped in passing), then exponential.
    assert len(sleeps) == 2
    assert 0.4 <= sleeps[0] <= 0.4 + 0.2 and 0.8 <= sleeps[1] <= 0.8 + 0.2


def test_a_504_from_a_balancer_is_retried(scripted, sleeps):
    """nginx's answer when a replica did not answer in time: the round is asked again."""
    server = scripted(error_reply(504, "Gateway Timeout", "no_replica"), content_length(OK_JSON))
    client = client_of(server)
    client._call("GET", "/health", None, None)
    assert client.retries_done == 1 and len(server.requests) == 2


def test_a_vocabulary_file_over_the_cap_is_refused_unread(scripted, monkeypatch):
    """GET /vocab is a tokenizer, never a model's weights: past the cap the drafter stops
    reading and says so."""
    import drafter.client as client_module

    monkeypatch.setattr(client_module, "MAX_VOCAB_FILE_BYTES", 1 << 20)
    server = scripted(content_length(b"G" * ((1 << 20) + 1)))
    with pytest.raises(VerifierUnavailable, match="vocabulary file is over 1 MiB"):
        client_of(server, max_retries=0).vocab_file()
    assert len(server.requests) == 1


def test_a_verifier_of_another_protocol_version_is_refused_saying_so():
    from drafter.drafters.compat import check_protocol
    from drafter.errors import DrafterError
    from server.shared.info import InfoResponse
    from server.shared.protocol import PROTOCOL_VERSION

    check_protocol(InfoResponse.model_construct(protocol_version=PROTOCOL_VERSION))
    with pytest.raises(DrafterError, match=f"protocol v{PROTOCOL_VERSION + 1}"):
        check_protocol(InfoResponse.model_construct(protocol_version=PROTOCOL_VERSION + 1))


def test_a_500_is_not_retried(scripted, sleeps):
    server = scripted(error_reply(500, "Internal Server Error", "decode_failed"))
    with pytest.raises(VerifierRejected, match="decode_failed"):
        client_of(server).verify(VerifyRequest(session_id=SESSION, n_past=5))
    assert len(server.requests) == 1


def test_an_answer_cut_off_is_asked_again_and_a_repeated_verify_is_safe(scripted, sleeps):
    def half_then_close(conn: socket.socket) -> None:
        conn.sendall(content_length(VERIFY_ANSWER)[:-4])
        conn.close()

    server = scripted(half_then_close, content_length(VERIFY_ANSWER))
    client = client_of(server)
    answer = client.verify(VerifyRequest(session_id=SESSION, n_past=5, draft_tokens=[7]))
    assert answer.tokens == [7, 8]
    assert client.retries_done == 1
    assert server.requests[0][1] == server.requests[1][1]  # the same request, again


def test_a_verifier_that_never_answers_is_given_up_on_after_the_retries(scripted, sleeps):
    server = scripted(hang_up, hang_up, b"garbage\r\n\r\n")
    client = client_of(server, max_retries=2)
    with pytest.raises(VerifierUnavailable, match="after 3 tries"):
        client._call("GET", "/health", None, None)
    assert len(server.requests) == 3


def test_nothing_listening_before_first_contact_is_reported_at_once(sleeps):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        client = VerifierClient(f"http://127.0.0.1:{port}", max_retries=3)
        with pytest.raises(VerifierUnavailable, match="Is the verifier running there") as info:
            client.info()
    assert "tries" not in str(info.value) and "<" not in str(info.value)
    assert client.retries_done == 0 and sleeps == []


def test_a_refused_connection_after_first_contact_is_retried(scripted, sleeps):
    server = scripted(content_length(OK_JSON))
    client = client_of(server, max_retries=1)
    client._call("GET", "/health", None, None)
    server.close()  # the verifier went away: a restart to wait out, not a wrong URL
    with pytest.raises(VerifierUnavailable, match="cannot be reached after 2 tries"):
        client._call("GET", "/health", None, None)
    assert client.retries_done == 1


def test_connection_close_from_the_server_opens_a_new_connection_without_a_retry(scripted):
    server = scripted(content_length(OK_JSON, b"Connection: close\r\n"), content_length(OK_JSON))
    client = client_of(server, max_retries=0)
    client._call("GET", "/x", None, None)
    client._call("GET", "/y", None, None)
    assert server.connections == 2 and client.retries_done == 0


def test_an_answer_the_drafter_does_not_understand_is_a_clear_error(scripted):
    server = scripted(content_length(b'{"status": "ok"}'))
    with pytest.raises(VerifierUnavailable, match="/info response this drafter does not"):
        client_of(server).info()


def test_a_malformed_session_id_is_never_sent(scripted):
    server = scripted(content_length(OK_JSON))
    with pytest.raises(VerifierUnavailable, match="not a session id"):
        client_of(server).delete_session("x\r\nInjected: 1")
    assert server.requests == []


@pytest.fixture
def tls_port() -> Iterator[int]:
    """A port that completes TLS handshakes with a certificate of a CA nobody trusts, then
    hangs up; a plain request there is refused by the handshake and closed."""
    import ssl

    trustme = pytest.importorskip("trustme")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    trustme.CA().issue_cert("127.0.0.1").configure_cert(context)
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with contextlib.suppress(ssl.SSLError, OSError):
                context.wrap_socket(conn, server_side=True).close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


def test_a_certificate_the_ca_does_not_vouch_for_is_not_retried(sleeps, tls_port):
    client = VerifierClient(f"https://127.0.0.1:{tls_port}", max_retries=3)
    with pytest.raises(
        VerifierUnavailable,
        match=r"TLS handshake \(cannot reach the verifier: \[SSL: CERTIFICATE_VERIFY_FAILED",
    ):
        client.info()
    assert client.retries_done == 0


def test_a_proxy_from_the_environment_carries_remote_verifiers_not_loopback(scripted, monkeypatch):
    proxy = scripted(content_length(OK_JSON))
    direct = scripted(content_length(OK_JSON))
    clear_proxies(monkeypatch)
    monkeypatch.setenv("HTTP_PROXY", f"127.0.0.1:{proxy.port}")  # no scheme: as curl reads it
    VerifierClient("http://verifier.example:8000")._call("GET", "/health", None, None)
    client_of(direct)._call("GET", "/health", None, None)
    ((_, proxied),) = proxy.requests
    assert proxied.startswith(b"GET http://verifier.example:8000/health HTTP/1.1\r\n")
    assert len(direct.requests) == 1


def test_no_proxy_is_read_as_curl_reads_it(monkeypatch):
    from drafter.client import proxy_for

    clear_proxies(monkeypatch)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.internal:3128")
    monkeypatch.setenv("NO_PROXY", "gpu.internal,.lan")
    assert proxy_for("https://verifier.example") == "http://proxy.internal:3128"
    assert proxy_for("https://gpu.internal:8000") is None
    assert proxy_for("https://box.lan") is None
    assert proxy_for("https://[::1]:8000") is None
    assert proxy_for("https://localhost:8000") is None


def test_a_proxy_of_another_kind_is_a_clear_error(monkeypatch):
    clear_proxies(monkeypatch)
    monkeypatch.setenv("HTTPS_PROXY", "socks5h://127.0.0.1:1080")
    with pytest.raises(VerifierUnavailable, match="not an http:// or https:// proxy"):
        VerifierClient("https://verifier.example:8443")


def clear_proxies(monkeypatch) -> None:
    """Python reads the lower-case names first: a test sets what it means, nothing else."""
    for name in ("http_proxy", "https_proxy", "no_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


def loading_reply() -> bytes:
    return error_reply(503, "Service Unavailable", "model_loading", b"Retry-After: 1\r\n")


def test_a_verifier_loading_its_model_is_waited_out_with_one_log_line(
    scripted, sleeps, caplog, monkeypatch
):
    """503 model_loading past the retries: the restart wait goes on, and says so once."""
    monkeypatch.setattr(RestartWait, "PAUSE_S", 0.0)
    server = scripted(*[loading_reply()] * 5, content_length(OK_JSON))
    client = client_of(server, max_retries=1, restart_wait_s=600)
    with caplog.at_level("WARNING", logger="drafter.client"):
        client._call("GET", "/health", None, None)
    waits = [r for r in caplog.records if "is restarting" in r.getMessage()]
    assert len(waits) == 1 and "model" in waits[0].getMessage()
    assert len(server.requests) == 6


def test_without_a_restart_wait_a_loading_verifier_is_given_up_on_after_the_retries(
    scripted, sleeps
):
    server = scripted(*[loading_reply()] * 3)
    client = client_of(server, max_retries=1, restart_wait_s=0)
    with pytest.raises(VerifierRejected, match="said so"):
        client._call("GET", "/health", None, None)
    assert len(server.requests) == 2


def test_a_verifier_that_comes_back_on_its_port_is_waited_for(scripted, sleeps):
    """Refused connections after first contact: a restart, waited out until it answers
    again on the same port (here, a new server on it)."""
    server = scripted(content_length(OK_JSON))
    # One retry: the kept-alive connection may be found dead only when used.
    client = client_of(server, max_retries=1, restart_wait_s=600)
    client._call("GET", "/health", None, None)
    port = server.port
    server.close()
    tries = []

    def come_back_after_two_refusals(why: str) -> bool:
        tries.append(why)
        if len(tries) == 2:
            back = socket.create_server(("127.0.0.1", port))
            threading.Thread(target=answer_once, args=(back,), daemon=True).start()
        return True

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RestartWait, "goes_on", lambda self, why: come_back_after_two_refusals(why))
        client._call("GET", "/health", None, None)
    assert tries == ["its connections are refused"] * 2


def test_a_restart_is_not_waited_out_for_a_caller_who_has_gone(scripted, sleeps, caplog):
    """`serve`'s client hung up: its generation's wait ends at once, its slot freed."""
    server = scripted(content_length(OK_JSON))
    client = client_of(server, max_retries=1, restart_wait_s=600)
    client._call("GET", "/health", None, None)
    server.close()
    client.abandoned = lambda: True
    with (
        caplog.at_level("WARNING", logger="drafter.retry"),
        pytest.raises(VerifierUnavailable, match="cannot be reached"),
    ):
        client._call("GET", "/health", None, None)
    assert not [r for r in caplog.records if "is restarting" in r.getMessage()]


def answer_once(listener: socket.socket) -> None:
    conn, _ = listener.accept()
    with conn, listener:
        conn.recv(65536)
        conn.sendall(content_length(OK_JSON))


def test_http_to_a_tls_port_fails_at_once_saying_use_https(tls_port):
    """A plain request to a TLS server is closed unanswered: not retried before first
    contact, and the error says the port speaks TLS."""
    client = VerifierClient(f"http://127.0.0.1:{tls_port}", max_retries=6)
    with pytest.raises(VerifierUnavailable, match=r"speaks TLS there: use https://"):
        client.info()
    assert client.retries_done == 0
