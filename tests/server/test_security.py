"""Auth matrix (after llama.cpp's test_security.py), body limits, replayed rounds."""

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from scripts.harness.metrics import Metrics
from server.verifier.edge.app import create_app
from server.verifier.settings import VerifierSettings
from tests.conftest import TEST_N_CTX, TEST_THREADS
from tests.server.conftest import wait_healthy

KEY_A, KEY_B, KEY_FILE_KEY = "alpha-key-123", "bravo-key-456", "from-the-file-789"
KEY_ADMIN = "admin-key-000"


@pytest.fixture(scope="module")
def secure(verifier_model, tmp_path_factory) -> Iterator[TestClient]:
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# verifier keys\n{KEY_FILE_KEY}\n")
    settings = VerifierSettings(
        model_path=verifier_model,
        n_ctx=TEST_N_CTX,
        n_threads=TEST_THREADS,
        max_sessions=4,
        max_draft=8,
        api_keys=f"{KEY_A},{KEY_B}",
        api_key_file=key_file,
        admin_api_keys=KEY_ADMIN,
        max_body_bytes=64 * 1024,
    )
    with TestClient(create_app(settings)) as client:
        wait_healthy(client)
        yield client


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def assert_401(response):
    assert response.status_code == 401, response.text
    assert response.json()["error"]["type"] == "unauthorized"
    assert response.headers["www-authenticate"] == "Bearer"


PROTECTED = [
    ("GET", "/info", None),
    ("GET", "/metrics", None),
    ("GET", "/vocab", None),
    ("GET", "/openapi.json", None),
    ("GET", "/docs", None),
    ("POST", "/prefill", {"prompt": "hi"}),
    ("POST", "/verify", {"session_id": "x", "n_past": 1}),
    ("POST", "/generate", {"prompt": "hi", "max_tokens": 1}),
    ("DELETE", "/sessions/x", None),
    ("GET", "/no-such-route", None),  # fails closed: unknown paths need a key too
    ("GET", "/health/../info", None),
]


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED)
def test_no_key_is_401_everywhere_but_health(secure, method, path, body):
    assert_401(secure.request(method, path, json=body))


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED[:3])
@pytest.mark.parametrize(
    "headers",
    [
        bearer("wrong"),
        {"X-API-Key": "wrong"},
        {"Authorization": f"Basic {KEY_A}"},
        {"Authorization": "Bearer"},
        bearer(KEY_A[:-1]),
        bearer(KEY_A + "x"),
    ],
)
def test_wrong_keys_are_401(secure, method, path, body, headers):
    assert_401(secure.request(method, path, json=body, headers=headers))


@pytest.mark.parametrize(
    "headers",
    [
        bearer(KEY_A),
        {"X-API-Key": KEY_B},
        bearer(KEY_FILE_KEY),
        {"authorization": f"bearer {KEY_A}"},
    ],
)
def test_each_way_of_giving_a_valid_key(secure, headers):
    assert secure.get("/info", headers=headers).status_code == 200


def test_metrics_need_an_admin_key_which_opens_the_rest_too(secure):
    refused = secure.get("/metrics", headers=bearer(KEY_A))
    assert refused.status_code == 403 and refused.json()["error"]["type"] == "forbidden"
    assert "VERIFIER_ADMIN_API_KEYS" in refused.json()["error"]["message"]
    assert secure.get("/metrics", headers=bearer(KEY_ADMIN)).status_code == 200
    assert secure.get("/info", headers=bearer(KEY_ADMIN)).status_code == 200
    assert_401(secure.get("/metrics", headers=bearer("not-a-key")))


def test_refused_keys_are_counted_401_in_the_metrics(secure):
    def refused() -> float:
        text = secure.get("/metrics", headers=bearer(KEY_ADMIN)).text
        return Metrics(text).value("verifier_requests_total", status="401")

    before = refused()
    assert_401(secure.post("/prefill", json={"prompt": "hi"}, headers=bearer("not-a-key")))
    assert_401(secure.get("/info"))
    assert refused() == before + 2


def test_health_stays_open(secure):
    assert secure.get("/health").status_code == 200


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "127.0.0.1:8000", "internal"])
def test_a_forged_host_header_does_not_open_anything(secure, host):
    assert_401(secure.get("/info", headers={"Host": host}))
    assert_401(secure.post("/prefill", json={"prompt": "hi"}, headers={"Host": host}))


def test_a_session_belongs_to_the_key_that_opened_it(secure):
    opened = secure.post("/prefill", json={"prompt": "Hello"}, headers=bearer(KEY_A)).json()
    round_ = {"session_id": opened["session_id"], "n_past": opened["total_tokens"]}
    other = secure.post("/verify", json=round_, headers=bearer(KEY_B))
    assert other.status_code == 404
    assert other.json()["error"]["type"] == "session_not_found"
    assert (
        secure.delete(f"/sessions/{opened['session_id']}", headers=bearer(KEY_B)).status_code == 404
    )
    assert secure.post("/verify", json=round_, headers=bearer(KEY_A)).status_code == 200
    assert (
        secure.delete(f"/sessions/{opened['session_id']}", headers=bearer(KEY_A)).status_code == 204
    )


def test_bodies_over_the_limit_are_413(secure):
    huge = {"prompt": "x" * (70 * 1024)}
    response = secure.post("/prefill", json=huge, headers=bearer(KEY_A))
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "payload_too_large"
    assert response.headers["connection"] == "close"  # the rest of the body is not read

    def chunked():
        for _ in range(80):
            yield b"x" * 1024

    response = secure.post(
        "/prefill", content=chunked(), headers={**bearer(KEY_A), "content-type": "application/json"}
    )
    assert response.status_code == 413


def test_a_replayed_round_gets_the_same_answer_and_changes_nothing(secure):
    headers = bearer(KEY_A)
    opened = secure.post("/prefill", json={"prompt": "The sun is"}, headers=headers).json()
    round_ = {
        "session_id": opened["session_id"],
        "n_past": opened["total_tokens"],
        "draft_tokens": [253, 2365],
    }
    first = secure.post("/verify", json=round_, headers=headers).json()
    again = secure.post("/verify", json=round_, headers=headers).json()
    assert again == first
    following = secure.post(
        "/verify",
        json={"session_id": opened["session_id"], "n_past": first["total_tokens"]},
        headers=headers,
    )
    assert following.status_code == 200
    stale = secure.post("/verify", json={**round_, "draft_tokens": [1]}, headers=headers)
    assert stale.status_code == 409
    assert stale.headers["x-total-tokens"] == str(following.json()["total_tokens"])
    assert f"total_tokens={following.json()['total_tokens']}" in stale.json()["error"]["message"]


def test_a_forged_session_id_header_of_another_keys_session_gets_404(secure):
    """X-Session-Id routes a request at a balancer; it opens nothing at the verifier.
    (The id is guessable here only to play the attacker who knows it.)"""
    session_id = "victim-session-0000000000001"
    opened = secure.post(
        "/prefill", json={"prompt": "Hello", "session_id": session_id}, headers=bearer(KEY_A)
    ).json()
    assert opened["session_id"] == session_id
    forged = {**bearer(KEY_B), "X-Session-Id": session_id}
    round_ = {"session_id": session_id, "n_past": opened["total_tokens"]}
    other = secure.post("/verify", json=round_, headers=forged)
    assert other.status_code == 404
    assert other.json()["error"]["type"] == "session_not_found"
    assert secure.delete(f"/sessions/{session_id}", headers=forged).status_code == 404
    mine = {**bearer(KEY_A), "X-Session-Id": session_id}
    assert secure.post("/verify", json=round_, headers=mine).status_code == 200
    assert secure.delete(f"/sessions/{session_id}", headers=mine).status_code == 204
