"""Connections a client cannot hold: through the shipped nginx front (the supported way to
expose a verifier), half-sent headers and trickled bodies are closed after its client
timeout and one address gets only so many connections; on the verifier itself, a body
that does not arrive in time is a 408. Meanwhile another client's rounds are answered.
Deadlines here are generous bounds on waiting for a state, never measurements."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from scripts.harness.local import free_port
from scripts.harness.replicas import LocalBalancer, LocalReplicas, NginxMissing
from server.verifier.settings import VerifierSettings
from tests.conftest import start_verifier, verifier_env

pytestmark = pytest.mark.integration

CLIENT_TIMEOUT_S = 5  # long beside opening a few dozen connections, short for a test
MAX_CONNS = 20
HOSTILE = "127.0.0.3"  # the hostile client's own address (all of 127/8 is loopback)


@pytest.fixture(scope="module")
def front(verifier_model):
    try:
        replicas = LocalReplicas(
            1,
            verifier_env(verifier_model),
            VerifierSettings().max_body_bytes,
            client_timeout_s=CLIENT_TIMEOUT_S,
            max_conns=MAX_CONNS,
        )
    except NginxMissing as exc:
        pytest.fail(str(exc))  # never a silent skip: the front is what is under test
    yield replicas
    replicas.stop()


def hostile_socket(port: int, payload: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=60, source_address=(HOSTILE, 0))
    sock.sendall(payload)
    return sock


def ended(sock: socket.socket) -> bytes:
    """What the server sent before it closed (or reset) the connection; waits for that."""
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except ConnectionResetError:  # nginx's reset_timedout_connection
        pass
    finally:
        sock.close()
    return data


def a_round_is_answered(url: str) -> bool:
    opened = httpx.post(f"{url}/prefill", json={"prompt": "still here"}, timeout=60).json()
    body = {"session_id": opened["session_id"], "n_past": opened["total_tokens"]}
    answer = httpx.post(f"{url}/verify", json=body, timeout=60)
    httpx.delete(f"{url}/sessions/{opened['session_id']}", timeout=60)
    return answer.status_code == 200


def test_half_sent_requests_are_closed_and_capped_while_rounds_go_on(front):
    port = front.balancer.port
    # Headers never finished: closed at the header timeout (nginx counts a connection
    # against limit_conn only once its headers are read).
    half_headers = [
        hostile_socket(port, b"POST /verify HTTP/1.1\r\nHost: x\r\n") for _ in range(10)
    ]
    # Headers whole, the body trickling: held until the body timeout, and beyond
    # MAX_CONNS of them from one address, refused at once.
    trickled = [
        hostile_socket(
            port,
            b"POST /prefill HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{",
        )
        for _ in range(MAX_CONNS + 10)
    ]
    assert a_round_is_answered(front.url)  # another client is served meanwhile
    answers = [ended(sock) for sock in [*half_headers, *trickled]]
    refused = [a for a in answers if b" 429 " in a.split(b"\r\n")[0]]
    assert len(refused) >= 10
    assert all(a == b"" or b" 408 " in a or b" 429 " in a for a in answers), answers
    assert a_round_is_answered(front.url)


@pytest.mark.parametrize("body_sent", [b'{"prompt":', b""], ids=["part of it", "none of it"])
def test_on_the_verifier_itself_a_body_too_slow_is_a_408(verifier_model, body_sent):
    verifier = start_verifier(verifier_model, body_timeout_s=CLIENT_TIMEOUT_S)
    try:
        began = time.monotonic()
        sock = socket.create_connection(("127.0.0.1", verifier.port), timeout=60)
        sock.sendall(
            b"POST /prefill HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n" + body_sent
        )
        answer = ended(sock)
        assert b" 408 " in answer.split(b"\r\n")[0] and b"request_timeout" in answer
        assert b"\r\nconnection: close\r\n" in answer.lower()
        assert time.monotonic() - began < 60  # a bound on the wait, not a measurement
        assert a_round_is_answered(verifier.url)
    finally:
        verifier.stop()


def test_the_fronts_own_errors_come_in_the_verifiers_error_shape():
    """No replica to reach, a body over the limit: nginx answers them itself, in the shape
    the drafter reads (a 502 it retries, a 413 it does not)."""
    try:
        balancer = LocalBalancer([f"127.0.0.1:{free_port()}"], max_body_bytes=64 * 1024)
    except NginxMissing as exc:
        pytest.fail(str(exc))
    try:
        unreachable = httpx.post(f"{balancer.url}/verify", json={"n_past": 1}, timeout=60)
        assert unreachable.status_code == 502
        assert unreachable.json()["error"]["type"] == "no_replica"
        too_large = httpx.post(
            f"{balancer.url}/prefill", json={"prompt": "x" * (65 * 1024)}, timeout=60
        )
        assert too_large.status_code == 413
        assert too_large.json()["error"]["type"] == "body_too_large"
    finally:
        balancer.stop()
