"""One HTTP/1.1 keep-alive connection, as little as the verifier protocol needs.

A round is one small request and one small response, and the standard library's
`http.client` spends a round's worth of protocol budget on building headers line by line
and parsing the answer through `email.parser` (about 0.2 ms a request here, cold from
a model's decode). This writes each request in one `sendall` and reads the answer with a
byte-level parser: status line, headers, then a body framed by Content-Length, chunked
transfer coding, or the end of the connection (RFC 9112 section 6.3).
"""

from __future__ import annotations

import socket
import ssl
from typing import NamedTuple

MAX_HEAD_BYTES = 64 * 1024
RECV_BYTES = 64 * 1024


class StaleConnection(ConnectionError):
    """The peer closed a kept-alive connection before answering anything."""


class BadResponse(OSError):
    """What came back is not an HTTP/1.x response this parser can frame."""


class IncompleteResponse(OSError):
    """The connection ended partway through an answer: the request may have been
    processed, so it is retried only with the caller's backoff, never resent at once."""


class Reply(NamedTuple):
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes
    wire_bytes: int  # status line, headers and body as received

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name), None)


class Connection:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout: float,
        ssl_context: ssl.SSLContext | None = None,
    ):
        self.host = host
        self.port = port
        self.timeout = timeout
        self.ssl_context = ssl_context
        self._sock: socket.socket | None = None
        self._buffer = bytearray()
        self.will_close = False  # the last response asked for the connection to end

    @property
    def is_open(self) -> bool:
        return self._sock is not None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._buffer.clear()
        self.will_close = False

    def request(self, message: bytes, *, head_only: bool = False) -> Reply:
        """Send one whole request (head and body in `message`) and read its response.

        `head_only` is for HEAD requests, whose responses have headers but no body.
        A connection that was kept alive and is found closed before the first byte of
        the answer raises StaleConnection, so the caller can resend at once.
        """
        fresh = self._sock is None
        if fresh:
            self._connect()
        sock = self._sock
        try:
            sock.sendall(message)
            reply = self._read_response(head_only, fresh)
        except BaseException:
            self.close()
            raise
        if self.will_close:
            self.close()
        return reply

    def _connect(self) -> None:
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        try:
            # A round is one write each way: Nagle would hold it for the peer's ACK.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_context is not None:
                sock = self.ssl_context.wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._buffer.clear()

    def _fill(self) -> bool:
        """Read what the socket has into the buffer; False at end of stream."""
        chunk = self._sock.recv(RECV_BYTES)
        if not chunk:
            return False
        self._buffer += chunk
        return True

    def _read_head(self, fresh: bool) -> tuple[bytes, int]:
        while True:
            end = self._buffer.find(b"\r\n\r\n")
            if end >= 0:
                head = bytes(self._buffer[:end])
                del self._buffer[: end + 4]
                return head, end + 4
            if len(self._buffer) > MAX_HEAD_BYTES:
                raise BadResponse(f"response headers longer than {MAX_HEAD_BYTES} bytes")
            if not self._fill():
                if not self._buffer and not fresh:
                    raise StaleConnection("the verifier closed the kept-alive connection")
                raise IncompleteResponse("the verifier closed the connection mid-response")

    def _read_response(self, head_only: bool, fresh: bool) -> Reply:
        wire_bytes = 0
        while True:
            head, head_bytes = self._read_head(fresh)
            wire_bytes += head_bytes
            status, reason, version, headers = _parse_head(head)
            if status >= 200:
                break
            fresh = True  # an interim 1xx answer: the real one follows
        fields = {name.lower(): value for name, value in headers}
        connection = fields.get("connection", "").lower()
        self.will_close = "close" in connection or (
            version == "HTTP/1.0" and "keep-alive" not in connection
        )
        if head_only or status in (204, 304):
            body = b""
        elif fields.get("transfer-encoding", "").lower().rsplit(",", 1)[-1].strip() == "chunked":
            body, used = self._read_chunked()
            wire_bytes += used
        elif "content-length" in fields:
            length_text = fields["content-length"]
            if not (length_text.isascii() and length_text.isdigit()):
                raise BadResponse(f"bad Content-Length {length_text!r}")
            length = int(length_text)
            body = self._read_exactly(length)
            wire_bytes += length
        else:  # delimited by the end of the connection
            while self._fill():
                pass
            body = bytes(self._buffer)
            self._buffer.clear()
            wire_bytes += len(body)
            self.will_close = True
        return Reply(status, reason, headers, body, wire_bytes)

    def _read_exactly(self, length: int) -> bytes:
        while len(self._buffer) < length:
            if not self._fill():
                raise IncompleteResponse("the verifier closed the connection mid-body")
        body = bytes(self._buffer[:length])
        del self._buffer[:length]
        return body

    def _read_line(self) -> bytes:
        while (end := self._buffer.find(b"\r\n")) < 0:
            if len(self._buffer) > MAX_HEAD_BYTES:
                raise BadResponse("a chunk-size line too long")
            if not self._fill():
                raise IncompleteResponse("the verifier closed the connection mid-body")
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 2]
        return line

    def _read_chunked(self) -> tuple[bytes, int]:
        parts: list[bytes] = []
        used = 0
        while True:
            line = self._read_line()
            used += len(line) + 2
            size_text = line.split(b";", 1)[0].strip()
            if not size_text or size_text.strip(b"0123456789abcdefABCDEF"):
                raise BadResponse(f"bad chunk size {line[:40]!r}")
            size = int(size_text, 16)
            if size == 0:
                while trailer := self._read_line():  # trailers, up to the empty line
                    used += len(trailer) + 2
                return b"".join(parts), used + 2
            parts.append(self._read_exactly(size))
            if self._read_line():
                raise BadResponse("a chunk longer than its size")
            used += size + 2


def _parse_head(head: bytes) -> tuple[int, str, str, list[tuple[str, str]]]:
    status_line, *lines = head.decode("latin-1").split("\r\n")
    version, _, rest = status_line.partition(" ")
    code, _, reason = rest.partition(" ")
    well_formed = code.isascii() and code.isdigit() and len(code) == 3
    if not version.startswith("HTTP/1.") or not well_formed:
        raise BadResponse(f"not an HTTP/1.x response: {status_line[:80]!r}")
    headers = []
    for line in lines:
        name, colon, value = line.partition(":")
        if not colon:
            raise BadResponse(f"bad header line: {line[:80]!r}")
        headers.append((name.strip(), value.strip()))
    return int(code), reason, version, headers


def header_lines(headers: list[tuple[str, str]]) -> bytes:
    """`Name: value` lines, each ending in CRLF, for a request head."""
    return "".join(f"{name}: {value}\r\n" for name, value in headers).encode("latin-1")
