"""Packing on the real model (server/verifier/kv/sessions.py): a sequence copied to another
id answers exactly as it did where it was, first on the runtime, bit for bit, then through
a real uvicorn whose cached and reused prefixes moved, token for token against the
reference decoder."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from server.shared.runtime import BatchEntry, LlamaRuntime
from tests.conftest import TEST_THREADS, start_verifier

pytestmark = pytest.mark.integration

PROMPTS = [
    "The old lighthouse keeper climbed the stairs every evening to light the lamp, and",
    "A recipe for bread needs flour, water, salt and yeast, and the baker starts by",
    "In the first chapter of the manual, the engineer explains how the pump works:",
    "Rivers carry sand and stones to the sea, and over thousands of years the delta",
]
MAX_TOKENS = 24


def test_a_copied_sequence_answers_bit_for_bit_as_the_original(verifier_model):
    """llama.cpp copies a stream's buffers at the start of the next decode: copies
    chained before it (0 to 1, then 1 to 2), the sources emptied and 0 written anew in
    that very decode, and 2 still answers exactly as 0 did."""
    runtime = LlamaRuntime(verifier_model, n_ctx_per_seq=256, n_seq_max=3, n_threads=TEST_THREADS)
    try:
        prompt = runtime.tokenize(PROMPTS[0], add_special=True)
        other = runtime.tokenize(PROMPTS[1], add_special=True)
        last = len(prompt) - 1

        def evaluate(seq_id: int, tokens: list[int]) -> None:
            runtime.decode([BatchEntry(t, i, seq_id, False) for i, t in enumerate(tokens)])

        def next_row(seq_id: int) -> np.ndarray:
            return runtime.decode([BatchEntry(prompt[-1], last, seq_id, True)])

        evaluate(0, prompt[:-1])
        original = next_row(0)
        runtime.remove(0, last)  # back to the prompt but its last token
        runtime.copy(0, 1)
        runtime.copy(1, 2)
        runtime.clear(0)
        runtime.clear(1)
        assert runtime.next_position(2) == last
        evaluate(0, other)  # the decode that applies the copies writes 0's stream
        assert np.array_equal(next_row(2), original)
    finally:
        runtime.close()


@pytest.fixture(scope="module")
def packing_verifier(verifier_model):
    verifier = start_verifier(verifier_model, max_sessions=5)
    info = httpx.get(f"{verifier.url}/info", timeout=30).json()
    if not (info["batch_invariant"] and info["prefix_cache"]):
        verifier.stop()
        pytest.skip("this build is not batch- and chunk-invariant: no prefix reuse to move")
    yield verifier
    verifier.stop()


def moved(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("verifier_moved_sequences_total "):
            return float(line.split()[1])
    raise AssertionError("no verifier_moved_sequences_total in /metrics")


def speculate(url: str, opened: dict) -> list[int]:
    """Rounds of three draft tokens (the first one the last answer's, so some are
    accepted and some are not) until MAX_TOKENS."""
    out: list[int] = []
    n_past = opened["total_tokens"]
    with httpx.Client(timeout=120) as client:
        while len(out) < MAX_TOKENS:
            draft = [out[-1] if out else 13, 13, 198]
            body = {"session_id": opened["session_id"], "n_past": n_past, "draft_tokens": draft}
            answer = client.post(f"{url}/verify", json=body)
            assert answer.status_code == 200, answer.text
            round_ = answer.json()
            out += round_["tokens"]
            n_past = round_["total_tokens"]
            if round_["eos"]:
                break
    return out[:MAX_TOKENS]


def test_sessions_whose_prefixes_moved_answer_as_the_verifier_alone(packing_verifier, reference):
    url = packing_verifier.url

    def prefill(prompt: str) -> dict:
        response = httpx.post(f"{url}/prefill", json={"prompt": prompt}, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    first, ending, third = (prefill(p) for p in PROMPTS[:3])
    assert ending["prompt_len"] > 16  # long enough to be cached (prefix_cache_min_tokens)
    assert httpx.delete(f"{url}/sessions/{ending['session_id']}", timeout=30).status_code == 204
    before = moved(url)
    newcomer = prefill(PROMPTS[3])  # takes the ended session's id; its prefix moves up
    again = prefill(PROMPTS[1] + " then kneads the dough")  # reuses that prefix, moved down
    assert again["cached_tokens"] > 0
    assert moved(url) - before == 2
    sessions = [first, third, newcomer, again]
    with ThreadPoolExecutor(len(sessions)) as pool:  # side by side: rounds share passes
        answers = list(pool.map(lambda s: speculate(url, s), sessions))
    for opened, answer in zip(sessions, answers, strict=True):
        expected = reference.greedy(opened["prompt_ids"], MAX_TOKENS)
        assert answer == expected
