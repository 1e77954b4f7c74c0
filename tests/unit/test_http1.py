"""The drafter's HTTP/1.1 connection against a scripted server on 127.0.0.1: framing,
keep-alive, stale connections and exact byte counts."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from drafter.client import VerifierClient
from drafter.errors import VerifierUnavailable
from drafter.http1 import BadResponse, Connection, IncompleteResponse, StaleConnection

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


def connection(server: ScriptedServer) -> Connection:
    return Connection("127.0.0.1", server.port, timeout=5.0)


GET = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


def test_content_length_bodies_on_one_kept_alive_connection(scripted):
    server = scripted(content_length(OK_JSON), content_length(b"[1,2,3]"))
    conn = connection(server)
    first = conn.request(GET)
    second = conn.request(GET)
    assert (first.status, first.reason, first.body) == (200, "OK", OK_JSON)
    assert first.header("content-type") == "application/json"
    assert second.body == b"[1,2,3]"
    assert server.connections == 1
    assert first.wire_bytes == len(content_length(OK_JSON))


def test_headers_and_body_in_separate_writes(scripted):
    def split(conn: socket.socket) -> None:
        whole = content_length(OK_JSON)
        conn.sendall(whole[:10])
        conn.sendall(whole[10:-3])
        conn.sendall(whole[-3:])

    reply = connection(scripted(split)).request(GET)
    assert reply.body == OK_JSON


def test_chunked_body_with_extensions_and_trailers(scripted):
    wire = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;note=x\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: 1\r\n\r\n"
    )
    server = scripted(wire, content_length(OK_JSON))
    conn = connection(server)
    reply = conn.request(GET)
    assert reply.body == b"hello world"
    assert reply.wire_bytes == len(wire)
    assert conn.request(GET).body == OK_JSON  # the framing left nothing behind
    assert server.connections == 1


def test_interim_1xx_is_skipped_and_counted(scripted):
    wire = b"HTTP/1.1 100 Continue\r\n\r\n" + content_length(OK_JSON)
    reply = connection(scripted(wire)).request(GET)
    assert reply.status == 200
    assert reply.wire_bytes == len(wire)


def test_connection_close_and_close_delimited_bodies(scripted):
    def close_delimited(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.0 200 OK\r\n\r\nuntil the end")
        conn.close()

    server = scripted(content_length(OK_JSON, b"Connection: close\r\n"), close_delimited)
    conn = connection(server)
    assert conn.request(GET).body == OK_JSON
    assert not conn.is_open  # the server said it would close
    assert conn.request(GET).body == b"until the end"
    assert server.connections == 2


def test_204_has_no_body(scripted):
    server = scripted(b"HTTP/1.1 204 No Content\r\n\r\n", content_length(OK_JSON))
    conn = connection(server)
    assert conn.request(GET).body == b""
    assert conn.request(GET).body == OK_JSON


@pytest.mark.parametrize(
    "wire",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: many\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n-5\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
        "HTTP/1.1 2\u00b2\u00b3 OK\r\n\r\n".encode("latin-1"),
    ],
)
def test_what_is_not_http_is_a_bad_response(scripted, wire):
    conn = connection(scripted(wire))
    with pytest.raises(BadResponse):
        conn.request(GET)
    assert not conn.is_open


def test_a_closed_kept_alive_connection_is_stale(scripted):
    def hang_up(conn: socket.socket) -> None:
        conn.close()

    conn = connection(scripted(content_length(OK_JSON), hang_up))
    conn.request(GET)
    with pytest.raises(StaleConnection):
        conn.request(GET)
    # On a fresh connection the same thing is a real failure, not a stale one.
    conn = connection(scripted(hang_up))
    with pytest.raises(IncompleteResponse):
        conn.request(GET)


def test_a_close_mid_answer_is_not_resent_at_once(scripted):
    def half_then_close(conn: socket.socket) -> None:
        conn.sendall(content_length(OK_JSON)[:-4])
        conn.close()

    server = scripted(content_length(OK_JSON), half_then_close, content_length(b'{"c":3}'))
    client = VerifierClient(f"http://127.0.0.1:{server.port}", max_retries=1)
    pauses = []
    client._pause = lambda attempt, retry_after: pauses.append(attempt)
    client._call("GET", "/x", None, None)
    client._call("GET", "/y", None, None)  # answered in part: retried after a pause
    assert pauses == [0]
    assert [request.split(b" ")[1] for _, request in server.requests] == [b"/x", b"/y", b"/y"]


def test_client_resends_once_at_once_on_a_stale_connection(scripted):
    def hang_up(conn: socket.socket) -> None:
        conn.close()

    server = scripted(content_length(b'{"a":1}'), hang_up, content_length(b'{"b":2}'))
    client = VerifierClient(f"http://127.0.0.1:{server.port}", max_retries=0)
    assert client._call("GET", "/x", None, None) is None
    assert client._call("GET", "/y", None, None) is None  # resent on a new connection
    assert client.retries_done == 0
    assert server.connections == 2
    assert [request.split(b" ")[1] for _, request in server.requests] == [b"/x", b"/y", b"/y"]


def test_client_counts_the_bytes_on_the_wire(scripted):
    from drafter.errors import VerifierRejected
    from server.protocol import PrefillRequest

    error = b'{"error":{"code":404,"type":"session_not_found","message":"gone"}}'
    reply = b"HTTP/1.1 404 Not Found\r\ncontent-length: %d\r\n\r\n%s" % (len(error), error)
    server = scripted(reply)
    client = VerifierClient(f"http://127.0.0.1:{server.port}/base", api_key="k", max_retries=0)
    request = PrefillRequest(prompt="hi")
    with pytest.raises(VerifierRejected, match="gone"):
        client.prefill(request)
    ((_, sent),) = server.requests
    assert sent.startswith(b"POST /base/prefill HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nAuthorization: Bearer k\r\n" in sent
    assert sent.endswith(b"\r\n\r\n" + request.model_dump_json(exclude_none=True).encode())
    assert client.bytes_sent == len(sent)
    assert client.bytes_received == len(reply)


def test_client_gives_up_after_its_retries(scripted):
    server = scripted(b"garbage\r\n\r\n", b"garbage\r\n\r\n")
    client = VerifierClient(f"http://127.0.0.1:{server.port}", max_retries=1)
    client._pause = lambda attempt, retry_after: None  # no sleeping in a unit test
    with pytest.raises(VerifierUnavailable, match="after 2 tries"):
        client.info()
