"""Who may call `serve`: its own key, browser origins, and the paths without /v1. No
verifier is needed: a request that passes the guard fails later, for want of one."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from drafter.serve.app import create_app
from drafter.settings import DrafterSettings

KEY = "sk-local-serve"
CHAT = {"model": "any", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def client(**settings) -> TestClient:
    app = create_app(DrafterSettings(server="http://127.0.0.1:9", timeout=2, retries=0, **settings))
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def keyed():
    with client(serve_api_key=KEY, cors_origins=["http://localhost:3000"]) as api:
        yield api


def test_without_the_key_every_openai_route_is_a_401_in_openai_shape(keyed):
    for method, path in [
        ("post", "/v1/chat/completions"),
        ("post", "/chat/completions"),
        ("post", "/v1/completions"),
        ("get", "/v1/models"),
        ("get", "/models"),
        ("get", "/v1/nothing"),  # unknown paths too: nothing is told before the key
    ]:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {KEY}"}):
            body = {"json": CHAT} if method == "post" else {}
            response = getattr(keyed, method)(path, headers=headers, **body)
            assert response.status_code == 401, (path, headers)
            assert response.headers["www-authenticate"] == "Bearer"
            error = response.json()["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"


def test_the_key_is_checked_before_the_body_is_read(keyed):
    response = keyed.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 401


def test_with_the_key_a_request_goes_through(keyed):
    for headers in ({"authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        response = keyed.post("/v1/chat/completions", headers=headers, json=CHAT)
        assert response.status_code == 503  # past the guard: no verifier behind it
        assert response.json()["error"]["code"] == "verifier_unavailable"


def test_health_stays_open_for_probes(keyed):
    assert keyed.get("/health").status_code == 503  # answered: the verifier is down


def test_a_browser_origin_allowed_gets_cors_headers_even_on_a_refusal(keyed):
    origin = {"origin": "http://localhost:3000"}
    preflight = keyed.options(
        "/v1/chat/completions",
        headers={
            **origin,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    refused = keyed.post("/v1/chat/completions", headers=origin, json=CHAT)
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_an_origin_not_allowed_gets_no_cors_headers(keyed):
    preflight = keyed.options(
        "/v1/chat/completions",
        headers={"origin": "http://evil.example", "access-control-request-method": "POST"},
    )
    assert preflight.status_code == 400
    assert "access-control-allow-origin" not in preflight.headers


def test_without_settings_serve_is_open_and_sends_no_cors_headers():
    with client() as api:
        response = api.post("/chat/completions", json=CHAT, headers={"origin": "http://x.example"})
        assert response.status_code == 503  # the alias without /v1 answers, past no guard
        assert "access-control-allow-origin" not in response.headers
        assert api.options("/v1/models", headers={"origin": "http://x.example"}).status_code == 405


def test_cors_origins_come_from_a_repeated_flag_or_a_json_variable(monkeypatch):
    from typer.testing import CliRunner

    from drafter.cli import app, settings_from

    assert settings_from({"cors_origins": ["http://a", "http://b"]}).cors_origins == [
        "http://a",
        "http://b",
    ]
    monkeypatch.setenv("DRAFTER_CORS_ORIGINS", '["*"]')
    assert DrafterSettings().cors_origins == ["*"]
    monkeypatch.setenv("DRAFTER_SERVE_API_KEYS", "x")  # a typo of DRAFTER_SERVE_API_KEY
    result = CliRunner().invoke(app, ["serve", "--port", "1"])
    assert result.exit_code != 0
    assert "DRAFTER_SERVE_API_KEY" in result.output


def test_each_of_several_keys_gets_in_under_its_own_identity_never_the_key():
    from drafter.principals import PRINCIPAL
    from drafter.serve.access import ClientKeyGuard
    from server.shared.api_keys import ApiKeys

    seen: list[object] = []

    async def app(scope, receive, send):
        seen.append(scope.get(PRINCIPAL))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    guarded = TestClient(ClientKeyGuard(app, keys=ApiKeys(["sk-a", "sk-b"])))
    for key in ("sk-a", "sk-b", "sk-a"):
        assert (
            guarded.get("/v1/models", headers={"authorization": f"Bearer {key}"}).status_code == 204
        )
    assert guarded.get("/v1/models", headers={"x-api-key": "sk-c"}).status_code == 401
    assert seen == ["key-0", "key-1", "key-0"]


def test_serve_takes_keys_comma_separated_and_from_a_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("sk-file\n")
    with client(serve_api_key="sk-a,sk-b", serve_api_key_file=path) as api:
        for key in ("sk-a", "sk-b", "sk-file"):
            response = api.post("/v1/chat/completions", headers={"x-api-key": key}, json=CHAT)
            assert response.status_code == 503, key  # past the guard: no verifier
        assert api.post("/v1/chat/completions", json=CHAT).status_code == 401


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--history-scope", "key"], "needs client keys"),
        (["--serve-api-key", "sk-a", "--history-file", "h.jsonl"], "--history-scope user"),
    ],
)
def test_serve_refuses_a_history_scope_it_cannot_keep_to_before_it_starts(args, message):
    from typer.testing import CliRunner

    from drafter.cli import app

    result = CliRunner().invoke(app, ["serve", "--port", "1", *args])
    assert result.exit_code == 1
    assert message in result.output
