"""The verifier's HTTP API on the real Q8_0 model, through FastAPI's TestClient."""

import json

import pytest

from scripts.harness.metrics import Metrics
from tests.fixtures.invariants import check_engine
from tests.server.conftest import MAX_DRAFT, verifier_client

PROMPT = "The three primary colours are"


def assert_error(response, status: int, error_type: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "type", "message"}
    assert body["error"]["code"] == status
    assert body["error"]["type"] == error_type
    assert body["error"]["message"]
    return body["error"]


def prefill(client, **payload) -> dict:
    response = client.post("/prefill", json=payload or {"prompt": PROMPT})
    assert response.status_code == 200, response.text
    return response.json()


def verify(client, session: dict, n_past: int, draft: list[int]) -> dict:
    response = client.post(
        "/verify",
        json={"session_id": session["session_id"], "n_past": n_past, "draft_tokens": draft},
    )
    assert response.status_code == 200, response.text
    return response.json()


def generate(client, max_tokens: int, **prompt) -> list[int]:
    response = client.post(
        "/generate", json={**(prompt or {"prompt": PROMPT}), "max_tokens": max_tokens}
    )
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_health_and_info(client, verifier_model):
    assert client.get("/health").json() == {"status": "ok"}
    info = client.get("/info").json()
    assert info["n_vocab"] == 49152
    assert info["quantization"] == "Q8_0"
    assert info["max_draft"] == MAX_DRAFT
    assert info["max_sessions"] == 4
    assert info["flash_attn"] is True
    # Where it computes, and what sized its context: the tests' VERIFIER_N_CTX, below the
    # model's trained context.
    assert (info["n_ctx"], info["context_source"], info["n_ctx_train"]) == (1024, "asked", 8192)
    assert info["backend"] == ("CPU" if info["gpu_layers"] == 0 else info["backend"])
    assert info["device"] and info["n_layer"] == 30
    assert len(info["vocab_hash"]) == 64
    assert info["model_path"] == str(verifier_model)
    assert (info["vocab_type"], info["add_bos"], info["add_eos"]) == ("bpe", False, False)
    # Hashes of the checked ids [5, end) for every size a compatible vocabulary may have.
    assert sorted(int(end) for end in info["vocab_text_hashes"]) == list(range(49024, 49153))


def test_the_vocabulary_file_loads_vocab_only_and_tokenizes_as_the_verifier(
    client, engine, tmp_path
):
    from server.shared.runtime import LlamaVocab

    response = client.get("/vocab")
    assert response.status_code == 200
    assert response.content[:4] == b"GGUF"
    assert len(response.content) < 4 << 20  # the tokenizer only, no weights
    assert response.headers["etag"] == f'"{client.get("/info").json()["vocab_hash"]}"'
    etag = response.headers["etag"]
    # RFC 9110: the tag itself, weak or strong, in a list, or "*" matches; another does not.
    for none_match in (etag, f"W/{etag}", f'"other", {etag}', "*"):
        again = client.get("/vocab", headers={"If-None-Match": none_match})
        assert again.status_code == 304 and again.content == b"", none_match
        assert again.headers["etag"] == etag
    assert client.get("/vocab", headers={"If-None-Match": '"other"'}).status_code == 200
    path = tmp_path / "verifier.vocab.gguf"
    path.write_bytes(response.content)
    vocab = LlamaVocab(path, vocab_only=True)
    try:
        assert vocab.n_vocab == engine.runtime.n_vocab
        for text in [
            "Hello, world!",
            "<|im_start|>user\nça va?<|im_end|>",
            "def f(x):\n\treturn x",
        ]:
            for special in (True, False):
                assert vocab.tokenize(text, add_special=special) == engine.runtime.tokenize(
                    text, add_special=special
                )
        messages = [("system", "Be brief."), ("user", "Hi")]
        assert vocab.apply_chat_template(messages) == engine.runtime.apply_chat_template(messages)
    finally:
        vocab.close()


def test_prefill_returns_the_prompt_ids(client):
    session = prefill(client)
    assert session["prompt_len"] == len(session["prompt_ids"]) == session["total_tokens"]
    by_ids = prefill(client, prompt_tokens=session["prompt_ids"])
    assert by_ids["prompt_ids"] == session["prompt_ids"]


def test_generate_returns_tokens_text_and_timings(client):
    response = client.post("/generate", json={"prompt": PROMPT, "max_tokens": 12})
    body = response.json()
    assert len(body["tokens"]) == 12
    assert body["text"].strip()
    assert set(body["timings"]) == {"prompt_ms", "decode_ms", "total_ms", "tokens_per_s"}
    assert body["timings"]["tokens_per_s"] > 0


def test_verify_accepts_the_target_continuation(client):
    expected = generate(client, 9)
    session = prefill(client)
    n_past = session["total_tokens"]
    result = verify(client, session, n_past, expected[:8])
    assert result["accepted_prefix_len"] == 8
    assert result["tokens"] == expected[:9]  # 8 accepted drafts plus the bonus token
    assert result["preds"] == expected[:9]
    assert result["total_tokens"] == n_past + 9
    assert result["eos"] is False
    assert result["timings"]["decoded_tokens"] == 9


def test_verify_corrects_a_wrong_draft_and_trims_it(client):
    expected = generate(client, 12)
    session = prefill(client)
    n_past = session["total_tokens"]
    wrong = (expected[2] + 1) % 49152
    first = verify(client, session, n_past, [expected[0], expected[1], wrong, 17])
    assert first["accepted_prefix_len"] == 2
    assert first["tokens"] == expected[:3]
    # The rejected drafts left no trace: the rest still equals the verifier alone.
    n_past = first["total_tokens"]
    rest = []
    while len(rest) < 9:
        step = verify(client, session, n_past, [])
        rest += step["tokens"]
        n_past = step["total_tokens"]
    assert expected[:3] + rest == expected


def test_accepted_eos_draft_commits_nothing_after_it(client, engine):
    prompt = {"prompt": "<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n"}
    expected = generate(client, 40, **prompt)
    assert engine.runtime.is_eog(expected[-1]), "the prompt should end with EOS"
    session = prefill(client, **prompt)
    n_past = session["total_tokens"]
    committed = []
    while len(committed) < len(expected) - 3:  # get to three tokens before the EOS
        end = min(len(committed) + MAX_DRAFT, len(expected) - 4)
        step = verify(client, session, n_past, expected[len(committed) : end])
        committed += step["tokens"]
        n_past = step["total_tokens"]
    assert committed == expected[: len(committed)]
    tail = expected[len(committed) :]
    draft = [*tail, 11, 12, 13]  # EOS among the drafts, garbage after it
    result = verify(client, session, n_past, draft)
    assert result["tokens"] == tail
    assert result["accepted_prefix_len"] == len(tail) - 1
    assert result["eos"] is True
    assert result["total_tokens"] == n_past + len(tail)
    state = engine.session(session["session_id"])
    assert state.tokens[session["prompt_len"] :] == expected


def test_a_round_decodes_only_pending_and_draft_at_any_context_length(client, engine):
    for words in (3, 150, 700):
        session = prefill(client, prompt=" ".join(["word"] * words))
        state = engine.session(session["session_id"])
        # A prefix left by an earlier session of these words is reused, not evaluated.
        assert state.decoded_tokens == session["prompt_len"] - 1 - session["cached_tokens"]
        n_past = session["total_tokens"]
        for draft in ([], [5, 6, 7, 8], [9] * MAX_DRAFT):
            before = engine.runtime.decoded_tokens_total
            result = verify(client, session, n_past, draft)
            assert engine.runtime.decoded_tokens_total - before == len(draft) + 1
            assert result["timings"]["decoded_tokens"] == len(draft) + 1
            n_past = result["total_tokens"]
        client.delete(f"/sessions/{session['session_id']}")


def test_two_interleaved_sessions_equal_each_alone(client):
    prompt_b = {"prompt": "def add(a, b):"}
    alone_a = generate(client, 24)
    alone_b = generate(client, 24, **prompt_b)
    a, b = prefill(client), prefill(client, **prompt_b)
    out = {"a": [], "b": []}
    past = {"a": a["total_tokens"], "b": b["total_tokens"]}
    sessions = {"a": a, "b": b}
    drafts = {"a": alone_a, "b": alone_b}
    while len(out["a"]) < 24 or len(out["b"]) < 24:
        for name in ("a", "b"):
            if len(out[name]) >= 24:
                continue
            # Alternate a correct draft, a wrong one and none, so trims interleave too.
            done = len(out[name])
            draft = drafts[name][done : done + 3] if done % 2 == 0 else [7, 7]
            result = verify(client, sessions[name], past[name], draft[: 23 - done])
            out[name] += result["tokens"]
            past[name] = result["total_tokens"]
    assert out["a"][:24] == alone_a
    assert out["b"][:24] == alone_b


def test_n_past_mismatch_is_409_and_changes_nothing(client, engine):
    session = prefill(client)
    n_past = session["total_tokens"]
    state = engine.session(session["session_id"])
    before = list(state.tokens)
    response = client.post(
        "/verify",
        json={"session_id": session["session_id"], "n_past": n_past + 1, "draft_tokens": [1]},
    )
    error = assert_error(response, 409, "n_past_mismatch")
    assert f"total_tokens={n_past}" in error["message"]
    assert state.tokens == before


@pytest.mark.parametrize(
    ("payload", "status", "error_type"),
    [
        ({"n_past": "PAST", "draft_tokens": [49152]}, 400, "invalid_token"),
        ({"n_past": "PAST", "draft_tokens": [1] * (MAX_DRAFT + 1)}, 400, "draft_too_long"),
        ({"n_past": "PAST", "draft_tokens": [-1]}, 422, "invalid_request"),
        ({"n_past": "PAST", "draft_tokens": "abc"}, 422, "invalid_request"),
        ({"n_past": "PAST", "bogus": 1}, 400, "unknown_field"),
        ({"n_past": -3}, 422, "invalid_request"),
    ],
)
def test_bad_verify_input_leaves_the_session_intact(client, engine, payload, status, error_type):
    session = prefill(client)
    n_past = session["total_tokens"]
    body = {"session_id": session["session_id"], **payload}
    if body.get("n_past") == "PAST":
        body["n_past"] = n_past
    assert_error(client.post("/verify", json=body), status, error_type)
    # The session still decodes exactly as the verifier alone.
    expected = generate(client, 4)
    got = []
    while len(got) < 4:
        step = verify(client, session, n_past, [])
        got += step["tokens"]
        n_past = step["total_tokens"]
    assert got == expected


def test_unknown_and_deleted_sessions_are_404(client):
    assert_error(
        client.post("/verify", json={"session_id": "nope", "n_past": 1}), 404, "session_not_found"
    )
    session = prefill(client)
    assert client.delete(f"/sessions/{session['session_id']}").status_code == 204
    assert_error(client.delete(f"/sessions/{session['session_id']}"), 404, "session_not_found")
    assert_error(
        client.post(
            "/verify", json={"session_id": session["session_id"], "n_past": session["total_tokens"]}
        ),
        404,
        "session_not_found",
    )


def test_context_overflow(client):
    info = client.get("/info").json()
    too_long = {"prompt_tokens": [42] * info["n_ctx"]}
    assert_error(client.post("/prefill", json=too_long), 400, "context_overflow")
    session = prefill(client, prompt_tokens=[42] * (info["n_ctx"] - 2))
    n_past = session["total_tokens"]
    over = client.post(
        "/verify",
        json={"session_id": session["session_id"], "n_past": n_past, "draft_tokens": [1, 2, 3]},
    )
    assert_error(over, 400, "context_overflow")
    fits = verify(client, session, n_past, [1, 2])  # n_past + k == n_ctx: the last round
    assert fits["total_tokens"] <= info["n_ctx"] + 1


def test_malformed_json_and_empty_prompt(client):
    response = client.post(
        "/prefill", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert_error(response, 400, "malformed_json")
    assert_error(
        client.post("/prefill", json={"prompt": "", "add_bos": False}), 400, "empty_prompt"
    )
    assert_error(client.post("/prefill", json={}), 422, "invalid_request")
    assert_error(client.post("/prefill", json={"prompt_tokens": [49152]}), 400, "invalid_token")
    for bad in (
        {"sampling": {"temperature": 0.7}, "strategy": "greedy"},
        {"strategy": "match"},
        {"sampling": {"temperature": 0.7}, "strategy": "threshold"},
    ):
        assert_error(
            client.post("/prefill", json={"prompt": "x", **bad}), 400, "unsupported_sampling"
        )


def test_unknown_route_has_the_error_body(client):
    assert_error(client.get("/nope"), 404, "not_found")
    assert_error(client.get("/prefill"), 405, "method_not_allowed")


def test_sessions_beyond_capacity_evict_the_least_recently_used(client, engine):
    sessions = [prefill(client) for _ in range(engine.n_seq + 1)]
    assert engine.session_count == engine.n_seq
    first = sessions[0]
    assert_error(
        client.post(
            "/verify", json={"session_id": first["session_id"], "n_past": first["total_tokens"]}
        ),
        404,
        "session_not_found",
    )
    for session in sessions[1:]:
        client.delete(f"/sessions/{session['session_id']}")


def test_metrics_count_rounds_and_passes(client):
    expected = generate(client, 3)
    session = prefill(client)
    before = Metrics(client.get("/metrics").text)
    verify(client, session, session["total_tokens"], [expected[0], 7])  # one of two accepted
    verify(client, session, session["total_tokens"] + 2, [])  # a plain step: no draft
    after = Metrics(client.get("/metrics").text)

    def delta(name: str, **labels: str) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    assert delta("verifier_requests_total", endpoint="/verify", status="200") == 2
    assert delta("verifier_drafted_tokens_total") == 2
    assert delta("verifier_accepted_tokens_total") == 1
    assert delta("verifier_drafted_by_position_total", position="2") == 1
    # The speculation counters under the names llama.cpp's server and vLLM use.
    assert delta("verifier:spec_decode_num_drafts_total") == 1  # the step had no draft
    assert delta("verifier:spec_decode_num_draft_tokens_total") == 2
    assert delta("verifier:spec_decode_num_accepted_tokens_total") == 1
    assert delta("verifier:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 1
    assert delta("verifier:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 0
    # Two rounds, two decodes of one forward pass each, 3 + 1 rows of their own.
    assert delta("verifier_decodes_total", kind="rounds") == 2
    assert delta("verifier_forward_passes_total", kind="rounds") == 2
    assert delta("verifier_decoded_tokens_total") == 4
    assert delta("verifier_decode_seconds_count") == 2
    assert after.has("verifier_queue_depth") and after.has("verifier_active_sessions")


def test_verify_answers_replays_errors_and_is_documented(client):
    """POST /verify: the answer serialized once, a replay of it, a 409 with the session's
    count, its OpenAPI entry, its requests counted by status."""
    from server.shared.protocol import VerifyResponse

    session = prefill(client)
    n_past = session["total_tokens"]
    response = client.post("/verify", json={"session_id": session["session_id"], "n_past": n_past})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert int(response.headers["content-length"]) == len(response.content)
    body = VerifyResponse.model_validate_json(response.content)
    assert body.timings.engine_ms >= body.timings.decode_ms > 0
    stale = client.post("/verify", json={"session_id": session["session_id"], "n_past": n_past})
    assert stale.status_code == 200 and stale.json() == response.json()  # a replay
    wrong = client.post("/verify", json={"session_id": session["session_id"], "n_past": 0})
    assert wrong.status_code == 409 and wrong.headers["x-total-tokens"] == str(n_past + 1)
    assert wrong.json()["error"]["type"] == "n_past_mismatch"
    schema = client.get("/openapi.json").json()
    request_body = schema["paths"]["/verify"]["post"]["requestBody"]
    assert request_body["content"]["application/json"]["schema"]["$ref"].endswith("/VerifyRequest")
    text = client.get("/metrics").text
    assert 'verifier_requests_total{endpoint="/verify",status="409"}' in text


def metric_value(client, name: str) -> float:
    return Metrics(client.get("/metrics").text).value(name)


def test_this_cpu_build_is_batch_invariant_and_greedy_says_lossless(client, engine):
    """The startup probe decoded the real model three ways and found them bit-identical
    (a unit test shows the probe deciding false on logits that shift with the batch)."""
    info = client.get("/info").json()
    assert info["batch_invariant"] is True
    assert info["batch_max_diff"] == 0.0
    assert info["strategies"]["greedy"] is True
    # A round after the short context and one after the long one (invariance.LONG_CONTEXT).
    assert engine.invariance.positions == 2 * (MAX_DRAFT + 1)
    assert engine.invariance.argmax_agrees
    assert info["pinned_width"] == 0  # free shapes are exact here: nothing pinned
    assert prefill(client)["lossless"] is True
    check_engine(engine)


def test_draft_probs_must_match_the_draft_in_a_greedy_session_too(client, engine):
    expected = generate(client, 3)
    session = prefill(client)
    n_past = session["total_tokens"]
    state = engine.session(session["session_id"])
    before = list(state.tokens)
    base = {"session_id": session["session_id"], "n_past": n_past, "draft_tokens": expected[:2]}
    for probs in (
        [[[expected[0], 1.0]], [[expected[1], 1.0]], [[7, 1.0]]],  # a row too many
        [[[expected[0], 0.5]], [[expected[1], 1.0]]],  # not a distribution
    ):
        response = client.post("/verify", json={**base, "draft_probs": probs})
        assert_error(response, 400, "invalid_draft_probs")
        assert state.tokens == before
    # Well-formed probabilities are ignored by a greedy session.
    ok = {**base, "draft_probs": [[[expected[0], 1.0]], [[expected[1], 0.6], [9, 0.4]]]}
    result = client.post("/verify", json=ok)
    assert result.status_code == 200, result.text
    assert result.json()["tokens"] == expected[:3]


def test_an_unexpected_failure_in_verify_is_a_500_error_body(client, monkeypatch):
    from fastapi.testclient import TestClient

    scheduler = client.app.state.verifier.service.scheduler

    async def broken(request, owner="anonymous"):
        raise RuntimeError("a bug")

    monkeypatch.setattr(scheduler, "verify", broken)
    session_id = "0" * 32
    # As uvicorn serves it: the answer sent, the exception then logged (not raised here).
    served = TestClient(client.app, raise_server_exceptions=False)
    response = served.post("/verify", json={"session_id": session_id, "n_past": 1})
    error = assert_error(response, 500, "internal_error")
    assert "RuntimeError: a bug" in error["message"]
    assert client.get("/health").status_code == 200


def test_behind_a_root_path_verify_is_served_and_counted_once(client):
    """`uvicorn --root-path /api` (or a proxy's prefix): POST /verify is routed, and a
    duplicate's answer is counted with its round, not again."""
    from fastapi.testclient import TestClient

    prefixed = TestClient(client.app, root_path="/api")  # the app is already running
    session = prefixed.post("/api/prefill", json={"prompt": PROMPT}).json()
    body = {"session_id": session["session_id"], "n_past": session["total_tokens"]}
    body["draft_tokens"] = [1, 2]
    drafted = metric_value(client, "verifier_drafted_tokens_total")
    first = prefixed.post("/api/verify", json=body)
    assert first.status_code == 200, first.text
    assert prefixed.post("/api/verify", json=body).json() == first.json()  # a replay
    assert metric_value(client, "verifier_drafted_tokens_total") == drafted + 2
    assert prefixed.delete(f"/api/sessions/{session['session_id']}").status_code == 204


def test_the_probe_decides_prompt_reuse_and_a_next_turn_answers_as_cold(client, engine):
    """The second turn of a conversation: with reuse on (a build whose prompts' numbers
    do not depend on their cuts) it evaluates only what its own cold evaluation would not
    have written the same way (with tiled prompts, docs/numerics.md: at most the earlier
    turn's cells past its tiled part, and a tile); either way it answers exactly as
    /generate does for the same tokens."""
    info = client.get("/info").json()
    assert info["prefix_cache"] == info["prefill_chunk_invariant"]
    tile = info["prompt_tile_rows"]
    system = "You are a careful assistant. " * 12
    first = prefill(client, prompt=system + "Name a colour.")
    n_past, history = first["total_tokens"], list(first["prompt_ids"])
    for _ in range(3):
        step = verify(client, first, n_past, [])
        history += step["tokens"]
        n_past = step["total_tokens"]
    assert client.delete(f"/sessions/{first['session_id']}").status_code == 204
    turn = [*history, *engine.runtime.tokenize(" Another colour is", add_special=False)]
    reused_before = metric_value(client, "verifier_prompt_tokens_reused_total")
    decoded_before = engine.runtime.decoded_tokens_total
    second = prefill(client, prompt_tokens=turn)
    reused = second["cached_tokens"]
    if not info["prefix_cache"]:
        assert reused == 0
    elif not tile:
        assert reused == len(history) - 1
    else:
        assert len(first["prompt_ids"]) - 1 - 2 * tile <= reused <= len(history) - 1
    assert engine.runtime.decoded_tokens_total - decoded_before == len(turn) - 1 - reused
    assert metric_value(client, "verifier_prompt_tokens_reused_total") - reused_before == reused
    got, n_past = [], second["total_tokens"]
    while len(got) < 12:
        step = verify(client, second, n_past, [])
        got += step["tokens"]
        n_past = step["total_tokens"]
    alone = generate(client, 12, prompt_tokens=turn)
    assert len(alone) >= 4 and got[: len(alone)] == alone
    check_engine(engine)


def test_with_chunks_under_64_rows_reuse_is_exact_on_this_cpu(verifier_model):
    """VERIFIER_N_BATCH=32: every chunk takes the short-batch kernels, the probe finds a
    prompt's cuts irrelevant, reuse turns on, and a conversation's next turn evaluates only
    what is new and answers exactly as a server without reuse."""
    from fastapi.testclient import TestClient

    from server.verifier.edge.app import create_app
    from server.verifier.settings import VerifierSettings
    from tests.server.conftest import wait_healthy

    def turns(prefix_cache: bool) -> tuple[list[int], dict, list[int]]:
        settings = VerifierSettings(
            model_path=verifier_model,
            n_ctx=1024,
            n_threads=1,
            max_sessions=2,
            max_draft=8,
            n_batch=32,
            prefix_cache=prefix_cache,
        )
        with TestClient(create_app(settings)) as test_client:
            wait_healthy(test_client)
            info = test_client.get("/info").json()
            assert info["prefill_chunk_invariant"] is True
            assert info["prefix_cache"] is prefix_cache
            runtime = test_client.app.state.verifier.service.engine.runtime
            first = prefill(test_client, prompt="A short story about a lighthouse keeper. " * 6)
            n_past, history = first["total_tokens"], list(first["prompt_ids"])
            for draft in ([], [28, 30], []):
                step = verify(test_client, first, n_past, draft)
                history += step["tokens"]
                n_past = step["total_tokens"]
            test_client.delete(f"/sessions/{first['session_id']}")
            turn = [*history, *runtime.tokenize(" Then the storm came and", add_special=False)]
            before = runtime.decoded_tokens_total
            second = prefill(test_client, prompt_tokens=turn)
            evaluated = runtime.decoded_tokens_total - before
            got, n_past = [], second["total_tokens"]
            while len(got) < 16:
                step = verify(test_client, second, n_past, [])
                got += step["tokens"]
                n_past = step["total_tokens"]
            return history, {**second, "evaluated": evaluated}, got

    history, reused, with_reuse = turns(True)
    _, cold, without = turns(False)
    assert reused["cached_tokens"] == len(history) - 1 and cold["cached_tokens"] == 0
    assert reused["evaluated"] == reused["prompt_len"] - len(history)
    assert cold["evaluated"] == cold["prompt_len"] - 1
    assert with_reuse == without


def test_a_client_chosen_session_id_routes_every_request_of_the_session(client):
    """The id goes in the body and in X-Session-Id (a balancer hashes the header); a live
    id cannot be opened twice; header and body must agree."""
    session_id = "c0ffee00-0000-4000-8000-000000000001"
    routed = {"X-Session-Id": session_id}
    response = client.post("/prefill", json={"prompt": PROMPT, "session_id": session_id})
    assert response.status_code == 200, response.text
    session = response.json()
    assert session["session_id"] == session_id
    again = client.post("/prefill", json={"prompt": PROMPT, "session_id": session_id})
    assert_error(again, 409, "session_exists")
    round_ = {"session_id": session_id, "n_past": session["total_tokens"], "draft_tokens": []}
    assert client.post("/verify", json=round_, headers=routed).status_code == 200
    wrong = {"X-Session-Id": "another-session-000000000002"}
    assert_error(client.post("/verify", json=round_, headers=wrong), 400, "session_id_mismatch")
    assert_error(
        client.delete(f"/sessions/{session_id}", headers=wrong), 400, "session_id_mismatch"
    )
    doubled = [("X-Session-Id", session_id), ("X-Session-Id", session_id)]
    assert_error(client.post("/verify", json=round_, headers=doubled), 400, "session_id_mismatch")
    assert client.delete(f"/sessions/{session_id}", headers=routed).status_code == 204
    # The header alone names the new session (curl users can route without the body).
    by_header = client.post("/prefill", json={"prompt": PROMPT}, headers=routed).json()
    assert by_header["session_id"] == session_id
    client.delete(f"/sessions/{session_id}")
    # Without either the server chooses, as before.
    assert prefill(client)["session_id"] != session_id


@pytest.mark.parametrize(
    "bad", ["x" * 21, "has spaces in it, twenty-two+", "x" * 65, "-leading-dash-0000000000"]
)
def test_a_session_id_that_is_not_a_token_is_refused(client, bad):
    response = client.post("/prefill", json={"prompt": PROMPT, "session_id": bad})
    assert "session_id" in assert_error(response, 422, "invalid_request")["message"]
    header_only = client.post("/prefill", json={"prompt": PROMPT}, headers={"X-Session-Id": bad})
    assert_error(header_only, 400, "session_id_mismatch")


def test_the_vocabulary_file_is_built_once_however_many_ask_at_once(client, monkeypatch):
    """Several clients asking at the same moment (or the same one twice) get the same
    file, written once: the build reads the whole model's metadata."""
    import threading

    import server.verifier.scheduling.service as service

    service_state = client.app.state.verifier.service
    monkeypatch.setattr(service_state, "_vocab_file", None)
    builds: list[object] = []
    build = service.vocab_only_gguf

    def counted(path):
        builds.append(path)
        return build(path)

    monkeypatch.setattr(service, "vocab_only_gguf", counted)
    bodies: list[bytes] = []
    threads = [
        threading.Thread(target=lambda: bodies.append(client.get("/vocab").content))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(bodies) == 3 and len(set(bodies)) == 1 and bodies[0][:4] == b"GGUF"
    assert len(builds) == 1


def test_a_prefill_whose_client_hung_up_leaves_no_session(client, engine):
    """The client is gone by the time the prompt is evaluated: nobody will ever learn the
    session's id, so it must not hold a sequence until the idle TTL."""
    session_id = "hung-up-prefill-session-0001"
    body = json.dumps({"prompt": PROMPT, "session_id": session_id}).encode()
    messages = iter([{"type": "http.request", "body": body, "more_body": False}])
    sent: list[dict] = []

    async def receive() -> dict:  # no await inside: answers at once, even when cancelled
        return next(messages, {"type": "http.disconnect"})

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/prefill",
        "raw_path": b"/prefill",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"host", b"testserver")],
        "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
    }
    client.portal.call(client.app, scope, receive, send)
    check_engine(engine)  # every sequence free, reserved or held: none leaked
    assert_error(client.delete(f"/sessions/{session_id}"), 404, "session_not_found")
    # The id is free again: a client that chose it and retries opens its session.
    assert prefill(client, prompt=PROMPT, session_id=session_id)["session_id"] == session_id
    assert client.delete(f"/sessions/{session_id}").status_code == 204


@pytest.fixture(scope="module")
def routed(verifier_model):
    """The same verifier with POST /verify answered by its FastAPI route."""
    with verifier_client(verifier_model, max_sessions=2, verify_fast_path=False) as client:
        yield client


@pytest.mark.parametrize(
    ("content", "headers"),
    [
        (b"", {"content-type": "application/json"}),
        (b'{"session_id": "s", "n_past": 1}', {"content-type": "text/plain"}),
        (
            b'{"session_id": "s", "n_past": 1}',
            {"content-type": "application/x-www-form-urlencoded"},
        ),
        (b'{"session_id": "s", "n_past": "1"}', {"content-type": "application/json"}),
        (b"{not json", {"content-type": "application/json"}),
        (b'{"session_id": "s", "n_past": 1}', {"content-type": "application/json; charset=utf-8"}),
    ],
)
def test_the_fast_path_answers_bad_input_as_the_route_does(client, routed, content, headers):
    fast = client.post("/verify", content=content, headers=headers)
    route = routed.post("/verify", content=content, headers=headers)
    assert (fast.status_code, fast.json()["error"]["type"]) == (
        route.status_code,
        route.json()["error"]["type"],
    )
    assert fast.status_code in (400, 404, 422)
