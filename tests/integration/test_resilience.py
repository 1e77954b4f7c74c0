"""Faults: TLS, a lost response, kill -9 and restart, SIGTERM mid-round, a client that
hangs up. Real models, real uvicorn on 127.0.0.1; outputs must equal undisturbed runs."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import httpx
import pytest
from typer.testing import CliRunner

from drafter.cli import app
from drafter.client import VerifierClient
from drafter.drafters.model import DraftModel, DraftPolicy
from drafter.speculative.loop import SpeculativeLoop
from scripts.harness.local import free_port
from scripts.harness.metrics import Metrics
from scripts.harness.restart import CLIENTS, run_drills
from server.shared.defaults import REPO_ROOT
from server.shared.protocol import PrefillRequest, SamplingParams, VerifyRequest
from tests.conftest import TEST_N_CTX, TEST_THREADS, start_verifier, verifier_env

pytestmark = pytest.mark.integration

PROMPT = "The rules of chess say that"
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def draft_model(drafter_model):
    model = DraftModel(drafter_model, n_ctx=TEST_N_CTX + 256, n_threads=TEST_THREADS)
    yield model
    model.close()


@pytest.fixture(scope="module")
def undisturbed(live_verifier) -> list[int]:
    return httpx.post(
        f"{live_verifier.url}/generate",
        json={"prompt": PROMPT, "max_tokens": NEW_TOKENS},
        timeout=120,
    ).json()["tokens"]


def run_with_hook(url: str, model: DraftModel, hook, **client_args) -> tuple[list[int], object]:
    model.reset()
    with VerifierClient(url, timeout=30, **client_args) as client:
        loop = SpeculativeLoop(model, client, draft_n=4, n_ctx=TEST_N_CTX)
        for i, _ in enumerate(loop.run(PrefillRequest(prompt=PROMPT), NEW_TOKENS)):
            hook(i)
        return loop.result.tokens, (loop.result.stats, client.retries_done)


def test_a_round_over_https_with_a_private_ca(verifier_model, tmp_path, undisturbed):
    """The certificates made as the docs make them (scripts/make_certs.sh, openssl)."""
    import subprocess

    made = subprocess.run(
        [str(REPO_ROOT / "scripts" / "make_certs.sh"), "127.0.0.1", "localhost"],
        env={**os.environ, "CERT_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    key_path, cert_path, ca_path = (tmp_path / n for n in ("key.pem", "cert.pem", "ca.pem"))
    verifier = start_verifier(
        verifier_model,
        scheme="https",
        extra_args=("--ssl-keyfile", str(key_path), "--ssl-certfile", str(cert_path)),
    )
    try:
        runner = CliRunner()
        args = [
            "--server",
            verifier.url,
            "--prompt",
            PROMPT,
            "--max-tokens",
            str(NEW_TOKENS),
            "--output",
            "json",
            "--threads",
            str(TEST_THREADS),
        ]
        trusted = runner.invoke(app, [*args, "--ca-cert", str(ca_path)])
        assert trusted.exit_code == 0, trusted.output
        assert json.loads(trusted.stdout)["tokens"] == undisturbed
        untrusted = runner.invoke(app, [*args, "--retries", "0"])
        assert untrusted.exit_code == 1
        said = " ".join(untrusted.output.split())
        assert "certificate" in said.lower() and "--ca-cert ca.pem" in said
    finally:
        verifier.stop()


def test_a_lost_response_is_retried_safely(live_verifier, undisturbed):
    """The verifier committed the round but the answer never arrived: the same request
    again gets the same answer and commits nothing twice."""
    with VerifierClient(live_verifier.url) as client:
        opened = client.prefill(PrefillRequest(prompt=PROMPT))
        request = VerifyRequest(
            session_id=opened.session_id, n_past=opened.total_tokens, draft_tokens=undisturbed[:3]
        )
        lost = client.verify(request)  # pretend this answer was lost on the way
        retried = client.verify(request)
        assert retried == lost
        following = client.verify(
            VerifyRequest(session_id=opened.session_id, n_past=retried.total_tokens)
        )
        assert lost.tokens + following.tokens == undisturbed[: len(lost.tokens) + 1]
        client.delete_session(opened.session_id)


def test_a_restart_mid_generation_goes_unnoticed_by_the_cli_and_serve(
    verifier_model, drafter_model
):
    """SIGKILL after the verifier has answered two rounds, then the same command again on
    the same port: the CLI and `serve` (streamed and whole), each made with its default
    settings, finish with the verifier's own output (scripts/restart_drill.py's drills).
    Long enough that a whole answer's rounds without a draft, each as large as the
    verifier takes, are more than two."""
    drills = run_drills(
        verifier_env(verifier_model), drafter_model, PROMPT, 200, threads=TEST_THREADS
    )
    assert [d.client for d in drills] == list(CLIENTS)
    for drilled in drills:
        assert drilled.finished, drilled
        assert drilled.identical, drilled
        assert drilled.recoveries == 1, drilled


def test_sigterm_finishes_the_round_in_flight(verifier_model, draft_model, undisturbed):
    port = free_port()
    verifiers = [start_verifier(verifier_model, port=port)]
    in_flight: dict[str, object] = {}

    def generate_then_terminate(i: int) -> None:
        if i != 2:
            return
        url = verifiers[0].url
        body = json.dumps({"prompt": PROMPT, "max_tokens": NEW_TOKENS}).encode()
        # A /generate whose body is half sent: in flight, and it cannot end before the rest
        # is sent, which happens after SIGTERM. No race: a state, then the signal.
        with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
            conn.sendall(
                b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body[:10]
            )
            wait_for(lambda: in_progress(url) >= 2)  # that request, and this scrape
            verifiers[0].process.send_signal(signal.SIGTERM)
            conn.sendall(body[10:])
            in_flight["response"] = read_http_response(conn)
        verifiers[0].process.wait(timeout=60)
        verifiers.append(start_verifier(verifier_model, port=port))

    try:
        tokens, (stats, _) = run_with_hook(verifiers[0].url, draft_model, generate_then_terminate)
        status, answer = in_flight["response"]
        assert status == 200, answer
        assert json.loads(answer)["tokens"] == undisturbed  # finished, not cut off
        # uvicorn finishes gracefully, then re-raises SIGTERM for the conventional status.
        assert verifiers[0].process.returncode in (0, -signal.SIGTERM)
        assert tokens == undisturbed
        assert stats.recoveries == 1
    finally:
        for verifier in verifiers:
            verifier.stop()


@pytest.mark.parametrize("strategy", ["rejection", "match"])
def test_a_seeded_generation_goes_on_across_a_restart_as_if_none_came(
    verifier_model, draft_model, strategy
):
    """kill -9 after two rounds of a sampled, seeded generation, and the verifier started
    again on the same port: the drafter opens its session again from the prompt and the
    generated tokens, and the rest is what the undisturbed run gives (the verifier's
    draws go on from where the generation stands, not from the seed again)."""
    sampling = SamplingParams(temperature=1.0, seed=11)
    port = free_port()
    verifiers = [start_verifier(verifier_model, port=port)]

    def kill_and_restart(i: int) -> None:
        if i != 2:
            return
        verifiers[0].process.send_signal(signal.SIGKILL)
        verifiers[0].process.wait(timeout=60)
        verifiers.append(start_verifier(verifier_model, port=port))

    def run(hook) -> tuple[list[int], int]:
        model.reset()
        model.configure(DraftPolicy(sampling, sample_drafts=strategy == "rejection", seed=12))
        request = PrefillRequest(prompt=PROMPT, sampling=sampling, strategy=strategy)
        with VerifierClient(verifiers[-1].url, timeout=30) as client:
            loop = SpeculativeLoop(model, client, draft_n=4, n_ctx=TEST_N_CTX)
            for i, _ in enumerate(loop.run(request, NEW_TOKENS)):
                hook(i)
            return loop.result.tokens, loop.result.stats.recoveries

    model = draft_model
    try:
        undisturbed, _ = run(lambda i: None)
        disturbed, recoveries = run(kill_and_restart)
        assert recoveries == 1
        assert disturbed == undisturbed
    finally:
        for verifier in verifiers:
            verifier.stop()


def active_sessions(url: str) -> float:
    return Metrics.scrape(url).value("verifier_active_sessions")


def in_progress(url: str) -> float:
    return Metrics.scrape(url).value("verifier_requests_in_progress")


def wait_for(condition, deadline_s: float = 60.0) -> None:
    """Until `condition()` holds: a state that will come, waited for, not a timing."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, "the state never came"
        time.sleep(0.01)


def read_http_response(conn: socket.socket) -> tuple[int, str]:
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def test_a_client_that_hangs_up_leaves_no_session_behind_and_is_counted_499(live_verifier):
    def hung_up() -> float:
        return Metrics.scrape(live_verifier.url).value(
            "verifier_requests_total", endpoint="/generate", status="499"
        )

    before, hung_up_before = active_sessions(live_verifier.url), hung_up()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{live_verifier.url}/generate",
            json={"prompt": PROMPT, "max_tokens": 2000},
            timeout=0.5,
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (
        active_sessions(live_verifier.url) > before or hung_up() == hung_up_before
    ):
        time.sleep(0.1)
    assert active_sessions(live_verifier.url) == before
    assert hung_up() == hung_up_before + 1
    # Nothing is stuck: the next request is served at once.
    quick = httpx.post(
        f"{live_verifier.url}/generate", json={"prompt": PROMPT, "max_tokens": 2}, timeout=10
    )
    assert quick.status_code == 200


def test_a_replica_that_listens_after_loading_refuses_until_ready_and_exits_if_it_cannot(
    tmp_path,
):
    """VERIFIER_LISTEN_AFTER_LOAD: behind a passive balancer, a replica whose model fails
    to load must not sit in the ring answering 503: it ends, with the reason logged."""
    from scripts.harness.local import LocalVerifier

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF\x03\x00\x00\x00")  # a GGUF cut off: it fails in the load
    verifier = LocalVerifier(
        {"VERIFIER_MODEL_PATH": str(broken), "VERIFIER_LISTEN_AFTER_LOAD": "1"}
    )
    try:
        assert verifier.process.wait(timeout=120) == 3  # a guard, not a measure; no signal
        assert not verifier.healthy()
        assert "broken.gguf" in verifier.log_path.read_text()
    finally:
        verifier.stop()


MODEL_PROBLEMS = {
    "missing": (None, "no model file at"),
    "not gguf": (b"<html>a download that went wrong</html>", "is not a GGUF file"),
    "cut off": (b"GGUF\x03\x00\x00\x00", "could not load the verifier model"),
}


@pytest.mark.parametrize("problem", MODEL_PROBLEMS)
def test_a_model_that_cannot_load_ends_the_verifier_with_the_reason(tmp_path, problem):
    from scripts.harness.local import LocalVerifier

    content, reason = MODEL_PROBLEMS[problem]
    path = tmp_path / "model.gguf"
    if content is not None:
        path.write_bytes(content)
    verifier = LocalVerifier({"VERIFIER_MODEL_PATH": str(path)})
    try:
        assert verifier.process.wait(timeout=120) == 3  # a guard, not a measure
        log = verifier.log_path.read_text()
        assert reason in log and "model.gguf" in log
    finally:
        verifier.stop()


def test_told_to_wait_for_its_model_the_verifier_stays_up_and_health_says_why(tmp_path):
    from scripts.harness.local import LocalVerifier

    env = {"VERIFIER_MODEL_PATH": str(tmp_path / "later.gguf"), "VERIFIER_WAIT_FOR_MODEL": "1"}
    verifier = LocalVerifier(env)
    try:

        def health() -> httpx.Response | None:
            try:
                return httpx.get(f"{verifier.url}/health", timeout=5)
            except httpx.TransportError:
                return None  # not listening yet

        wait_for(lambda: (r := health()) is not None and r.json()["status"] == "error", 120)
        answer = health()
        assert answer.status_code == 503 and "later.gguf" in answer.json()["detail"]
        assert verifier.process.poll() is None
    finally:
        verifier.stop()


def test_a_port_in_use_ends_the_verifier_saying_so_before_anything_loads(verifier_model):
    import subprocess
    import sys

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        started = subprocess.run(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "server.main:app",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            env={**os.environ, "VERIFIER_MODEL_PATH": str(verifier_model)},
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert started.returncode != 0
    assert f"127.0.0.1:{port} is in use" in started.stderr
    assert "verifier ready" not in started.stderr + started.stdout


def test_a_mistyped_setting_ends_the_verifier_naming_the_one_meant(verifier_model):
    import subprocess
    import sys

    started = subprocess.run(
        [sys.executable, "-m", "uvicorn", "server.main:app", "--port", str(free_port())],
        env={**os.environ, "VERIFIER_MODEL_PATH": str(verifier_model), "VERIFIER_API_KEY": "k"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode != 0
    assert "VERIFIER_API_KEY is not a setting; did you mean VERIFIER_API_KEYS?" in started.stderr
