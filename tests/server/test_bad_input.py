"""A battery of bad requests: each a 4xx with the error body, none a 5xx, and the session
still decodes exactly as the verifier alone afterwards."""

import pytest

from tests.server.conftest import MAX_DRAFT

PROMPT = "A list of prime numbers:"


@pytest.fixture
def session(client):
    opened = client.post("/prefill", json={"prompt": PROMPT}).json()
    yield opened
    client.delete(f"/sessions/{opened['session_id']}")


def battery(sid: str, n_past: int, n_vocab: int, n_ctx: int) -> list[tuple[str, str, object]]:
    """(method, path, json body | raw bytes) — every one of them must be refused."""
    v = "/verify"
    ok = {"session_id": sid, "n_past": n_past}
    return [
        ("POST", v, {**ok, "draft_tokens": [n_vocab]}),
        ("POST", v, {**ok, "draft_tokens": [2**31 - 1]}),
        ("POST", v, {**ok, "draft_tokens": [2**31]}),
        ("POST", v, {**ok, "draft_tokens": [-1]}),
        ("POST", v, {**ok, "draft_tokens": [1.5]}),
        ("POST", v, {**ok, "draft_tokens": ["1"]}),
        ("POST", v, {**ok, "draft_tokens": [None]}),
        ("POST", v, {**ok, "draft_tokens": 5}),
        ("POST", v, {**ok, "draft_tokens": [1] * (MAX_DRAFT + 1)}),
        ("POST", v, {**ok, "draft_tokens": [1] * 10_000}),
        ("POST", v, {**ok, "n_past": n_past + 1}),
        ("POST", v, {**ok, "n_past": n_past - 1}),
        ("POST", v, {**ok, "n_past": -1}),
        ("POST", v, {**ok, "n_past": 10**30}),
        ("POST", v, {**ok, "n_past": "ten"}),
        ("POST", v, {**ok, "n_past": None}),
        ("POST", v, {"session_id": sid}),
        ("POST", v, {"n_past": n_past}),
        ("POST", v, {**ok, "session_id": ""}),
        ("POST", v, {**ok, "session_id": "x" * 500}),
        ("POST", v, {**ok, "session_id": "no-such-session"}),
        ("POST", v, {**ok, "unknown": True}),
        ("POST", v, {**ok, "draft_tokens": [1], "draft_probs": [[[1, 2.0]]]}),
        ("POST", v, []),
        ("POST", v, "just a string"),
        ("POST", v, b"{not json"),
        ("POST", v, b""),
        ("POST", v, b"\xff\xfe\x00garbage"),
        ("POST", v, b'{"session_id": "' + sid.encode() + b'", "n_past": 1e999}'),
        ("POST", v, b'{"session_id": "' + sid.encode() + b'", "n_past": NaN}'),
        ("GET", v, None),
        ("POST", "/prefill", {}),
        ("POST", "/prefill", {"prompt": "a", "prompt_tokens": [1]}),
        ("POST", "/prefill", {"prompt_tokens": [n_vocab]}),
        ("POST", "/prefill", {"prompt_tokens": [5] * n_ctx}),
        ("POST", "/prefill", {"prompt_tokens": []}),
        ("POST", "/prefill", {"prompt": "", "add_bos": False}),
        ("POST", "/prefill", {"prompt": 42}),
        ("POST", "/prefill", {"prompt": "x", "sampling": {"temperature": -1}}),
        ("POST", "/prefill", b'{"prompt": "x", "sampling": {"temperature": Infinity}}'),
        ("POST", "/prefill", {"prompt": "x", "sampling": {"top_p": 0}}),
        ("POST", "/prefill", {"prompt": "x", "sampling": {"top_k": -5}}),
        ("POST", "/prefill", {"prompt": "x", "sampling": {"seed": -1}}),
        ("POST", "/prefill", {"prompt": "x", "strategy": "bogus"}),
        (
            "POST",
            "/prefill",
            {"prompt": "x", "strategy": "threshold", "sampling": {"temperature": 1}},
        ),
        ("POST", "/prefill", {"prompt": "x", "add_bos": "maybe"}),
        ("POST", "/generate", {"prompt": "x", "max_tokens": 0}),
        ("POST", "/generate", {"prompt": "x", "max_tokens": 10**9}),
        ("POST", "/generate", {"prompt": "x", "max_tokens": -3}),
        ("POST", "/generate", {"max_tokens": 3}),
        ("DELETE", "/sessions/no-such-session", None),
        ("PUT", "/prefill", {"prompt": "x"}),
    ]


def test_every_bad_request_is_a_4xx_with_the_error_body(client, session):
    info = client.get("/info").json()
    n_past = session["total_tokens"]
    requests = battery(session["session_id"], n_past, info["n_vocab"], info["n_ctx"])
    assert len(requests) >= 40
    for method, path, body in requests:
        if isinstance(body, bytes):
            response = client.request(
                method, path, content=body, headers={"content-type": "application/json"}
            )
        else:
            response = client.request(method, path, json=body)
        assert 400 <= response.status_code < 500, (method, path, body, response.text)
        error = response.json()["error"]
        assert set(error) == {"code", "type", "message"}, response.text
        assert error["code"] == response.status_code
    # Nothing was lost or corrupted: the session goes on exactly as the verifier alone.
    expected = client.post("/generate", json={"prompt": PROMPT, "max_tokens": 6}).json()
    got, total = [], n_past
    while len(got) < 6:
        step = client.post(
            "/verify", json={"session_id": session["session_id"], "n_past": total}
        ).json()
        got += step["tokens"]
        total = step["total_tokens"]
    assert got == expected["tokens"]


def test_the_documented_codes_of_limits_that_no_other_test_names(client, verifier_model):
    """docs/protocol.md's statuses for a /generate past the server's limit, a temperature
    too small to be finite, and a loading model (503 with Retry-After, /health 503)."""
    from fastapi.testclient import TestClient

    from server.verifier.app import create_app
    from server.verifier.settings import VerifierSettings
    from tests.server.test_api import assert_error

    limit = client.app.state.verifier.settings.max_generate_tokens
    too_long = client.post("/generate", json={"prompt": "x", "max_tokens": limit + 1})
    assert_error(too_long, 400, "context_overflow")
    tiny = client.post("/prefill", json={"prompt": "x", "sampling": {"temperature": 1e-6}})
    assert tiny.status_code == 422 and tiny.json()["error"]["code"] == 422
    missing = VerifierSettings(
        model_path=verifier_model.parent / "absent.gguf", wait_for_model=True
    )
    with TestClient(create_app(missing)) as waiting:
        health = waiting.get("/health")
        assert health.status_code == 503 and health.json()["status"] in ("loading", "error")
        refused = waiting.post("/prefill", json={"prompt": "x"})
        assert_error(refused, 503, "model_loading")
        assert refused.headers["Retry-After"]
