"""Many drafters, one verifier: shared batches, session lifecycle, limits.

Real models, real uvicorn on 127.0.0.1, the real drafter loop in threads.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from drafter.client import VerifierClient
from drafter.drafters.model import DraftModel
from drafter.speculative.loop import SpeculativeLoop
from scripts.harness.metrics import Metrics
from server.shared.protocol import PrefillRequest, VerifyRequest
from tests.conftest import TEST_THREADS, start_verifier

pytestmark = pytest.mark.integration

PROMPTS = [
    "The history of the bicycle begins",
    "def merge_sort(items):\n",
    "Shopping list:\n1.",
    "<|im_start|>user\nName three planets.<|im_end|>\n<|im_start|>assistant\n",
    "Dear Sir or Madam,",
    "SELECT name, email FROM",
    "The recipe for bread needs",
    "In 1969, the first humans",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def busy_verifier(verifier_model):
    verifier = start_verifier(verifier_model, max_sessions=10, session_ttl_s=2, n_ctx=512)
    yield verifier
    verifier.stop()


@pytest.fixture(scope="module")
def tight_verifier(verifier_model):
    verifier = start_verifier(verifier_model, max_sessions=2, max_queue=2, n_ctx=256)
    yield verifier
    verifier.stop()


def solo(url: str, prompt: str, max_tokens: int = NEW_TOKENS) -> list[int]:
    response = httpx.post(
        f"{url}/generate", json={"prompt": prompt, "max_tokens": max_tokens}, timeout=120
    )
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def metric(url: str, name: str, **labels: str) -> float:
    return Metrics.scrape(url).value(name, **labels)


def drafted_run(url: str, model_path, prompt: str, n_ctx: int, hook=None) -> tuple[list, object]:
    model = DraftModel(model_path, n_ctx=n_ctx + 256, n_threads=TEST_THREADS)
    try:
        with VerifierClient(url) as client:
            loop = SpeculativeLoop(model, client, draft_n=4, n_ctx=n_ctx)
            for i, _ in enumerate(loop.run(PrefillRequest(prompt=prompt), NEW_TOKENS)):
                if hook:
                    hook(i)
            return loop.result.tokens, loop.result.stats
    finally:
        model.close()


def test_eight_concurrent_drafters_each_get_their_solo_output(busy_verifier, drafter_model):
    expected = {p: solo(busy_verifier.url, p) for p in PROMPTS}
    before = Metrics.scrape(busy_verifier.url)
    start = threading.Barrier(len(PROMPTS))

    def one(prompt: str):
        start.wait()
        return drafted_run(busy_verifier.url, drafter_model, prompt, 512)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = dict(zip(PROMPTS, pool.map(one, PROMPTS), strict=True))
    for prompt in PROMPTS:
        assert results[prompt][0] == expected[prompt], prompt
    after = Metrics.scrape(busy_verifier.url)

    def delta(name: str) -> float:
        return after.value(name, kind="rounds") - before.value(name, kind="rounds")

    # However the rounds arrived, every decode of rounds was shaped into one forward pass.
    assert delta("verifier_decodes_total") > 0
    assert delta("verifier_forward_passes_total") == delta("verifier_decodes_total")


def test_idle_sessions_expire_after_the_ttl(busy_verifier):
    with VerifierClient(busy_verifier.url) as client:
        opened = client.prefill(PrefillRequest(prompt="Hello"))
    # TTL 2 s, swept every second; how soon depends on the machine's load, so wait until
    # no session is left (every session of this module is idle by now), touching none.
    deadline = time.monotonic() + 60
    while metric(busy_verifier.url, "verifier_active_sessions") > 0:
        assert time.monotonic() < deadline, "idle sessions never expired"
        time.sleep(0.2)
    response = httpx.post(
        f"{busy_verifier.url}/verify",
        json={"session_id": opened.session_id, "n_past": opened.total_tokens},
    )
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "session_not_found"
    assert metric(busy_verifier.url, "verifier_expired_sessions_total") >= 1


def test_capacity_evicts_the_least_recently_used(tight_verifier):
    with VerifierClient(tight_verifier.url) as client:
        first = client.prefill(PrefillRequest(prompt="one"))
        second = client.prefill(PrefillRequest(prompt="two"))
        client.verify(VerifyRequest(session_id=first.session_id, n_past=first.total_tokens))
        third = client.prefill(PrefillRequest(prompt="three"))  # evicts `second`
        gone = httpx.post(
            f"{tight_verifier.url}/verify",
            json={"session_id": second.session_id, "n_past": second.total_tokens},
        )
        assert gone.status_code == 404
        for session in (first, third):
            client.delete_session(session.session_id)


def test_drafter_recovers_from_eviction_with_unchanged_output(tight_verifier, drafter_model):
    prompt = PROMPTS[0]
    expected = solo(tight_verifier.url, prompt)
    squatters = []

    def evict_after_second_round(i: int) -> None:
        if i == 1:  # two strangers fill the server: ours is the least recently used
            with VerifierClient(tight_verifier.url) as other:
                squatters.extend(other.prefill(PrefillRequest(prompt=f"x{n}")) for n in range(2))

    tokens, stats = drafted_run(
        tight_verifier.url, drafter_model, prompt, 256, hook=evict_after_second_round
    )
    assert tokens == expected
    assert stats.recoveries >= 1
    for session in squatters:
        httpx.delete(f"{tight_verifier.url}/sessions/{session.session_id}")


def test_a_full_queue_gets_503_and_nothing_else_breaks(tight_verifier):
    expected = solo(tight_verifier.url, "Count: one, two,", 12)
    statuses = []

    def hit(_):
        response = httpx.post(
            f"{tight_verifier.url}/generate",
            json={"prompt": "Count: one, two,", "max_tokens": 12},
            timeout=120,
        )
        if response.status_code == 503:
            assert response.headers["retry-after"]
            assert response.json()["error"]["type"] == "server_full"
        else:
            assert response.status_code == 200, response.text
            assert response.json()["tokens"] == expected
        statuses.append(response.status_code)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(hit, range(16)))
    assert 503 in statuses and 200 in statuses, statuses
    assert solo(tight_verifier.url, "Count: one, two,", 12) == expected


def test_context_overflow_ends_the_drafter_cleanly(tight_verifier, drafter_model):
    prompt = " ".join(["river"] * 230)
    tokens, _ = drafted_run(tight_verifier.url, drafter_model, prompt, 256)
    with VerifierClient(tight_verifier.url) as client:
        n_ctx = client.info().n_ctx
    expected = solo(tight_verifier.url, prompt, 200)
    assert tokens == expected[: len(tokens)]
    prompt_len = len(
        httpx.post(
            f"{tight_verifier.url}/generate", json={"prompt": prompt, "max_tokens": 1}
        ).json()["prompt_ids"]
    )
    assert prompt_len + len(tokens) == min(n_ctx + 1, prompt_len + NEW_TOKENS)
    over = httpx.post(f"{tight_verifier.url}/prefill", json={"prompt_tokens": [5] * n_ctx})
    assert over.status_code == 400 and over.json()["error"]["type"] == "context_overflow"
    assert str(n_ctx) in over.json()["error"]["message"]
