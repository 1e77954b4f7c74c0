"""`serve` as a chat app uses it, on the real models: multi-turn conversations that reuse
what both sides cached, requests at once, and clients that leave.

Reuse must never change a word: every turn is compared with the same turn against a
verifier whose prompt reuse is off (prompts cut in the same chunks, see
server/verifier/probe/invariance.py). States that depend on timing (a generation running, a client
gone)
are reached through a verifier proxy that holds rounds at a gate, never by waiting."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from tests.conftest import start_verifier
from tests.fixtures.gated_verifier import GatedVerifier
from tests.integration.test_openai_api import LocalAPI

pytestmark = pytest.mark.integration

SYSTEM = (
    "You are a careful assistant for a team that runs speculative decoding across two "
    "machines: a small draft model on a laptop proposes tokens and a large model on a "
    "server checks them. Answer in plain sentences, without lists, and keep every answer "
    "short, because the people reading them are busy engineers."
)
TURNS = [
    "Explain in two sentences why the server keeps one cache per conversation.",
    "And what happens to that cache when the conversation ends?",
    "Give one reason a prefix could not be reused.",
]
MAX_TOKENS = 24


def until(condition: Callable[[], bool], what: str, timeout_s: float = 90) -> None:
    """Wait for a state (not for a time): fails only if it never comes."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def exact(live_verifier) -> dict:
    """The verifier's /info; skips where this build cannot promise exactness (a GPU build
    may not be batch-invariant: reuse is then off, and batch-mates may change a token)."""
    info = httpx.get(f"{live_verifier.url}/info", timeout=30).json()
    if not (info["batch_invariant"] and info["prefix_cache"]):
        pytest.skip("this build is not batch- and chunk-invariant: no exactness to check")
    return info


@pytest.fixture(scope="module")
def prompt_chunk(exact) -> int:
    return exact["prompt_chunk"]


@pytest.fixture(scope="module")
def verifier_without_reuse(verifier_model, prompt_chunk):
    verifier = start_verifier(verifier_model, prefix_cache=False, prompt_chunk=prompt_chunk)
    yield verifier
    verifier.stop()


# A draft model that drafts every round, so that its cache is there to reuse: under `auto`
# it rests while the verifier advises no draft (drafter/speculative/warming.py), and has none.
DRAFTING = ("--draft-n", "4")


@pytest.fixture(scope="module")
def api_with_reuse(live_verifier):
    api = LocalAPI(live_verifier.url, *DRAFTING)
    yield api
    api.stop()


@pytest.fixture(scope="module")
def api_without_reuse(verifier_without_reuse):
    api = LocalAPI(verifier_without_reuse.url, *DRAFTING)
    yield api
    api.stop()


def converse(api: LocalAPI) -> list:
    """The three turns, each answer sent back with the next question, as chat apps do."""
    client = api.client()
    messages = [{"role": "system", "content": SYSTEM}]
    replies = []
    for question in TURNS:
        messages.append({"role": "user", "content": question})
        reply = client.chat.completions.create(
            model="any", messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        replies.append(reply)
    return replies


def test_a_conversation_reuses_both_caches_and_says_exactly_what_it_says_without(
    live_verifier, verifier_without_reuse, api_with_reuse, api_without_reuse
):
    assert httpx.get(f"{verifier_without_reuse.url}/info").json()["prefix_cache"] is False
    with_reuse, without = converse(api_with_reuse), converse(api_without_reuse)
    for turn, (on, off) in enumerate(zip(with_reuse, without, strict=True)):
        assert on.choices[0].message.content == off.choices[0].message.content, turn
        assert on.usage.prompt_tokens == off.usage.prompt_tokens
        assert off.usage.prompt_tokens_details.cached_tokens == 0
    tile = httpx.get(f"{live_verifier.url}/info").json()["prompt_tile_rows"]
    for before, turn in itertools.pairwise(with_reuse):
        # The earlier turn's prompt (and most of its answer) came from the caches; with
        # tiled prompts, all but a tile at worst (docs/numerics.md).
        cached = turn.usage.prompt_tokens_details.cached_tokens
        assert before.usage.prompt_tokens - 2 * tile <= cached < turn.usage.prompt_tokens
        draft_cached = turn.model_extra["speculative"]["draft_cached_tokens"]
        assert before.usage.prompt_tokens <= draft_cached < turn.usage.prompt_tokens


def test_streamed_usage_only_when_asked_for_and_with_cached_tokens(exact, api_with_reuse):
    client = api_with_reuse.client()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]

    def chunks(**extra) -> list:
        return list(
            client.chat.completions.create(
                model="any", messages=messages, max_tokens=8, temperature=0, stream=True, **extra
            )
        )

    plain = chunks()
    assert all(chunk.usage is None for chunk in plain)
    counted = chunks(stream_options={"include_usage": True})
    *texts, last = counted
    assert last.choices == [] and last.usage.completion_tokens == 8
    assert all(chunk.usage is None for chunk in texts)
    # The same prompt again: the verifier had all of it but the last token cached (with
    # tiled prompts too, whether or not the verifier, idle, evaluated its answer again
    # meanwhile: docs/numerics.md).
    n = last.usage.prompt_tokens - 1
    assert last.usage.prompt_tokens_details.cached_tokens == n
    text = "".join(c.choices[0].delta.content or "" for c in texts if c.choices)
    assert text == "".join(c.choices[0].delta.content or "" for c in plain if c.choices)


def test_requests_at_once_each_get_what_they_get_alone(exact, api_with_reuse):
    client = api_with_reuse.client()
    requests = [
        {"messages": [{"role": "user", "content": "Name three rivers in Europe."}]},
        {"messages": [{"role": "user", "content": "Write a title for: cache reuse."}]},
        # Seeded sampling: its sequence starts empty and decodes alone, so its draws
        # do not depend on the request beside it.
        {
            "messages": [{"role": "user", "content": "Tell me a one-line story."}],
            "temperature": 0.8,
            "seed": 11,
        },
    ]

    def ask(request: dict) -> str:
        request = {"model": "any", "max_tokens": 20, "temperature": 0, **request}
        return client.chat.completions.create(**request).choices[0].message.content

    alone = [ask(request) for request in requests]
    together: list[str | None] = [None] * len(requests)

    def run(i: int) -> None:
        together[i] = ask(requests[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert together == alone


COUNT = "Count from one to a hundred."
# Each API's streamed request of the same answer (the Responses and Messages APIs share
# the chat path underneath, and its hang-up handling).
STREAMED = {
    "chat": ("/chat/completions", {"messages": [{"role": "user", "content": COUNT}],
                                   "max_tokens": 200}),
    "responses": ("/responses", {"input": COUNT, "max_output_tokens": 200}),
    "messages": ("/messages", {"messages": [{"role": "user", "content": COUNT}],
                               "max_tokens": 200}),
}  # fmt: skip


@pytest.mark.parametrize("api_name", list(STREAMED))
def test_a_client_that_leaves_ends_its_generation_and_frees_its_verifier_session(
    live_verifier, api_name
):
    """One slot, no queue. Two rounds pass the proxy and the third is held: the
    generation is surely running; /health and /v1/models answer, another request gets
    429. The client closes its stream after its first chunks, and the held round is the
    last: the session is deleted. Through each API."""
    proxy = GatedVerifier(live_verifier.url)
    proxy.allow(2)
    api = LocalAPI(proxy.url, "--parallel", "1", "--queue", "0")
    base = api.url.removesuffix("/v1")
    path, fields = STREAMED[api_name]
    body = {"model": "any", **fields, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", f"{api.url}{path}", json=body, timeout=120) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert proxy.verify_held.wait(120), "the third round never reached the verifier"
            health = httpx.get(f"{base}/health", timeout=30).json()
            assert health["running"] == 1 and health["waiting"] == 0
            assert httpx.get(f"{api.url}/models", timeout=30).status_code == 200
            refused = httpx.post(f"{api.url}{path}", json={**body, "stream": False}, timeout=30)
            assert refused.status_code == 429
            assert int(refused.headers["Retry-After"]) > 0
            error = refused.json()["error"]
            if api_name == "messages":  # Anthropic's shape
                assert error["type"] == "rate_limit_error"
            else:
                assert error["code"] == "queue_full"
        # The stream is closed with its third round still held.
        until(lambda: httpx.get(f"{base}/health").json()["stopping"] == 1, "stop noticed")
        proxy.open()
        until(lambda: proxy.count("DELETE", "/sessions/") == 1, "session deleted")
        until(lambda: httpx.get(f"{base}/health").json()["running"] == 0, "slot freed")
        assert proxy.count("POST", "/verify") == 3  # no round after the client left
        assert all(status < 300 for _, _, status in proxy.passed)
    finally:
        api.stop()
        proxy.close()
