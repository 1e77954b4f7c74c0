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
        ("POST", "/prefill", b'{"prompt": "a lone \\ud800 surrogate"}'),
        ("POST", "/generate", b'{"prompt": "\\udfff", "max_tokens": 2}'),
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

    from server.verifier.edge.app import create_app
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
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        # Loading, or (the file is missing) failed to load: never a reason to wait long.
        assert refused.json()["error"]["type"] in ("model_loading", "model_failed")


@pytest.mark.parametrize("fast_path", [True, False])
def test_a_misspelled_field_is_a_400_naming_the_field_meant(verifier_model, fast_path):
    """The same answer from the /verify fast path and from FastAPI's route, and for a
    field inside a nested object."""
    from tests.server.conftest import verifier_client
    from tests.server.test_api import assert_error

    with verifier_client(verifier_model, verify_fast_path=fast_path) as client:
        opened = client.post("/prefill", json={"prompt": PROMPT}).json()
        body = {"session_id": opened["session_id"], "n_pastt": opened["total_tokens"]}
        error = assert_error(client.post("/verify", json=body), 400, "unknown_field")
        assert error["message"] == "unknown field 'n_pastt'; did you mean 'n_past'?"
        nested = {"prompt": "x", "sampling": {"temprature": 0.5}}
        error = assert_error(client.post("/prefill", json=nested), 400, "unknown_field")
        assert "'sampling.temprature'" in error["message"] and "'temperature'" in error["message"]


def test_the_fast_path_and_the_route_answer_every_input_alike(verifier_model):
    """The same bodies, valid and not, to POST /verify answered before routing and by
    FastAPI's route: the same status and the same body (timings aside). Bodies that are
    not JSON too, and text that is not Unicode: strings holding lone surrogates (in values
    and keys), bytes that are not UTF-8 (a surrogate's own bytes among them), UTF-16."""
    import json

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.server.conftest import verifier_client

    sid = "f" * 32
    texts = st.text(st.sampled_from(["a", "\u00e9", "\ud800", "\udfff", "\U0001f600"]), max_size=5)
    values = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-3, max_value=2**32),
        st.floats(allow_nan=False, allow_infinity=False),
        texts,
        st.lists(st.integers(min_value=-2, max_value=70000), max_size=20),
    )
    fields = st.sampled_from(
        ["session_id", "n_past", "draft_tokens", "draft_probs", "n_pastt", "n_\udc00"]
    )
    bodies = st.one_of(
        st.fixed_dictionaries(
            {"session_id": st.sampled_from([sid, "nobody", "", "\ud800"]), "n_past": values}
        ),
        st.dictionaries(fields, values, max_size=4),
        st.lists(st.integers(), max_size=2),
        values,
    )
    # As clients write JSON: ASCII, a lone surrogate as its escape ("\ud800").
    written = bodies.map(lambda body: json.dumps(body).encode())
    not_utf8 = st.sampled_from([b"\xff", b"\xed\xa0\x80", b"\xc3", b"\xfe\xff"])
    raw = st.one_of(
        written,
        st.builds(lambda text, bad, at: text[:at] + bad + text[at:], written, not_utf8,
                  st.integers(0, 40)),
        written.map(lambda text: text.decode().encode("utf-16")),
        st.binary(max_size=12),
    )  # fmt: skip

    with (
        verifier_client(verifier_model, verify_fast_path=True) as fast,
        verifier_client(verifier_model, verify_fast_path=False) as routed,
    ):
        for client in (fast, routed):
            opened = client.post("/prefill", json={"prompt": PROMPT, "session_id": sid})
            assert opened.status_code == 200, opened.text

        def answer(client, body: bytes) -> tuple[int, object]:
            response = client.post(
                "/verify", content=body, headers={"content-type": "application/json"}
            )
            content = json.loads(response.content.decode("utf-8"))
            if isinstance(content, dict):
                content.pop("timings", None)
            return response.status_code, content

        @settings(
            max_examples=200,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture],
        )
        @given(raw)
        def same(body):
            answered = answer(fast, body)
            assert answered == answer(routed, body), body
            assert answered[0] < 500, (body, answered)

        same()


@pytest.mark.parametrize("fast_path", [True, False])
def test_text_that_is_not_unicode_is_malformed_json_naming_where_before_any_work(
    verifier_model, fast_path, monkeypatch
):
    """A lone surrogate is valid JSON text that no UTF-8 can carry: in a prompt, a
    grammar's source (a schema's key or value, a GBNF string), a session id, anywhere,
    it is 400 malformed_json naming the field, before the prompt is tokenized or the
    grammar compiled; bytes that are not UTF-8 alike. The same text made whole decodes."""
    from tests.server.conftest import verifier_client
    from tests.server.test_api import assert_error

    def schema(source: str) -> bytes:
        return b'{"prompt": "x", "grammar": {"kind": "json_schema", "source": ' + source.encode()

    refused = [
        ("/prefill", b'{"prompt": "a lone \\ud800 surrogate"}', "prompt"),
        ("/prefill", schema('{"type": "string", "enum": ["\\ud800"]}}}'), "grammar.source.enum.0"),
        ("/prefill", schema('{"properties": {"\\udc00": {}}}}}'),
         "grammar.source.properties.\\udc00"),
        ("/prefill", b'{"prompt": "x", "grammar": {"kind": "gbnf", '
                     b'"source": "root ::= \\"\\ud800\\""}}', "grammar.source"),
        ("/generate", b'{"prompt": "\\udfff", "max_tokens": 2}', "prompt"),
        ("/verify", b'{"session_id": "\\ud800", "n_past": 1}', "session_id"),
        ("/verify", b'{"session_id": "s", "n_past": 1, "\\ud800": 1}', "\\ud800"),
        ("/prefill", b'{"prompt": "\xff"}', None),
        ("/prefill", b'{"prompt": "\xed\xa0\x80"}', None),
        ("/verify", b'{"session_id": "\xff", "n_past": 1}', None),
    ]  # fmt: skip
    with verifier_client(verifier_model, verify_fast_path=fast_path) as client:
        engine = client.app.state.verifier.service.engine
        tokenized: list[str] = []
        tokenize = engine.runtime.tokenize
        monkeypatch.setattr(
            engine.runtime,
            "tokenize",
            lambda text, **kw: tokenized.append(text) or tokenize(text, **kw),
        )
        for path, body, field in refused:
            response = client.post(path, content=body, headers={"content-type": "application/json"})
            message = assert_error(response, 400, "malformed_json")["message"]
            if field is None:
                assert "not UTF-8" in message, (path, body)
            else:
                assert message.startswith(f"{field}: ") and "lone surrogate" in message, message
        assert tokenized == []
        whole = b'{"prompt": "a pair \\ud83d\\ude00 and \\\\ud800 as text"}'
        opened = client.post(
            "/prefill", content=whole, headers={"content-type": "application/json"}
        )
        assert opened.status_code == 200, opened.text
        assert tokenized == ["a pair \U0001f600 and \\ud800 as text"]
        session = opened.json()
        step = client.post(
            "/verify", json={"session_id": session["session_id"], "n_past": session["total_tokens"]}
        )
        assert step.status_code == 200, step.text
        client.delete(f"/sessions/{session['session_id']}")


def test_a_prompt_text_that_cannot_fit_is_refused_before_it_is_tokenized(client, monkeypatch):
    """413 for a text over the bound, for /prefill and /generate alike, and the tokenizer
    never sees it; a text within it is tokenized off the engine thread."""
    import threading

    from tests.server.test_api import assert_error

    engine = client.app.state.verifier.service.engine
    limit = engine.max_prompt_chars
    assert limit >= engine.n_ctx
    seen: list[tuple[int, str]] = []
    tokenize = engine.runtime.tokenize

    def recorded(text, **kwargs):
        seen.append((len(text), threading.current_thread().name))
        return tokenize(text, **kwargs)

    monkeypatch.setattr(engine.runtime, "tokenize", recorded)
    too_long = "a" * (limit + 1)
    for path in ("/prefill", "/generate"):
        error = assert_error(client.post(path, json={"prompt": too_long}), 413, "prompt_too_long")
        assert str(limit) in error["message"]
    assert seen == []
    opened = client.post("/prefill", json={"prompt": PROMPT})
    assert opened.status_code == 200, opened.text
    ((length, thread),) = seen
    assert length == len(PROMPT) and thread.startswith("text")
    client.delete(f"/sessions/{opened.json()['session_id']}")


@pytest.mark.parametrize("fast_path", [True, False])
def test_a_body_nested_too_deep_to_read_is_malformed_json(verifier_model, fast_path):
    """Deeper than any JSON reader here recurses (pydantic's on the /verify fast path,
    json's under FastAPI's routes): 400 malformed_json saying so, and the verifier goes on."""
    from tests.server.conftest import verifier_client
    from tests.server.test_api import assert_error

    deep = b'{"prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}"
    json_type = {"content-type": "application/json"}
    with verifier_client(verifier_model, verify_fast_path=fast_path) as client:
        for path in ("/verify", "/prefill", "/generate"):
            response = client.post(path, content=deep, headers=json_type)
            error = assert_error(response, 400, "malformed_json")
            assert "nested too deep" in error["message"], path
        opened = client.post("/prefill", json={"prompt": PROMPT})
        assert opened.status_code == 200, opened.text
