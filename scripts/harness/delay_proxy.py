#!/usr/bin/env python3
"""A TCP proxy on loopback that delays every byte by a fixed time each way.

This kernel has no netem, so a round-trip delay between the drafter and the verifier is
made here: each chunk read from one side is written to the other `delay_ms / 2` later,
in order, with no bandwidth limit. Timing uses perf_counter and short sleeps (asyncio's
epoll timers round to whole milliseconds).

    .venv/bin/python scripts/harness/delay_proxy.py --target 127.0.0.1:8000 \\
        --listen-port 8001 --delay-ms 20
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import socket
import threading
import time

CHUNK = 65536


class DelayProxy:
    """Listens on 127.0.0.1:`port` and forwards to `target`, adding `delay_ms` per round
    trip (half on the way out, half on the way back)."""

    def __init__(self, target: tuple[str, int], delay_ms: float, listen_port: int = 0):
        if delay_ms < 0:
            raise ValueError("delay_ms must be >= 0")
        self.target = target
        self.one_way_s = delay_ms / 2000.0
        self._listener = socket.create_server(("127.0.0.1", listen_port))
        self.port = self._listener.getsockname()[1]
        self._closing = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._acceptor = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> DelayProxy:
        self._acceptor.start()
        return self

    def close(self) -> None:
        self._closing.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._sockets.clear()

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                if self._closing.is_set():
                    return
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets += [client, upstream]
            self._pipe(client, upstream)
            self._pipe(upstream, client)

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        """Two threads per direction: one reads and stamps, one waits and writes, so a
        chunk's delay never holds up the reading of the next."""
        due: queue.Queue[tuple[float, bytes]] = queue.Queue()

        def read() -> None:
            try:
                while chunk := source.recv(CHUNK):
                    due.put((time.perf_counter() + self.one_way_s, chunk))
            except OSError:
                pass
            due.put((time.perf_counter() + self.one_way_s, b""))

        def write() -> None:
            while True:
                at, chunk = due.get()
                wait_until(at)
                if not chunk:
                    with contextlib.suppress(OSError):
                        sink.shutdown(socket.SHUT_WR)
                    return
                try:
                    sink.sendall(chunk)
                except OSError:
                    return

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()


def wait_until(deadline: float) -> None:
    """Sleep to `deadline` (perf_counter seconds) within ~0.1 ms: a coarse sleep, then a
    few short ones."""
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left - 0.001 if left > 0.002 else left / 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="host:port to forward to")
    parser.add_argument("--listen-port", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, required=True, help="added round trip")
    args = parser.parse_args()
    host, _, port = args.target.rpartition(":")
    with DelayProxy((host, int(port)), args.delay_ms, args.listen_port) as proxy:
        print(f"proxy {proxy.url} -> {args.target}, +{args.delay_ms} ms round trip", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()


if __name__ == "__main__":
    main()
