"""A hostile client against the real verifier: duplicated rounds sent at once while a long
prefill keeps the engine busy. Real model, real uvicorn on 127.0.0.1.

Whatever the threads' timing (the duplicates may share a pass, wait behind the prefill,
or arrive after the first is answered), the answers must be identical and a bystander's
output must be exactly the verifier's own.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.integration

DUPLICATES = 6
BYSTANDER_TOKENS = 24


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def test_identical_rounds_at_once_during_a_long_prefill_get_identical_answers(live_verifier):
    url = live_verifier.url
    bystander_prompt = {"prompt": "The history of the bicycle begins"}
    expected = post(url, "/generate", {**bystander_prompt, "max_tokens": BYSTANDER_TOKENS})
    expected = expected.json()["tokens"]
    reference = post(url, "/generate", {"prompt": "Shopping list:\n1.", "max_tokens": 5})
    draft = reference.json()["tokens"][:4]

    target = post(url, "/prefill", {"prompt": "Shopping list:\n1."}).json()
    bystander = post(url, "/prefill", bystander_prompt).json()
    round_body = {
        "session_id": target["session_id"],
        "n_past": target["total_tokens"],
        "draft_tokens": draft,
    }
    start = threading.Barrier(DUPLICATES + 2)

    def duplicate(_: int) -> httpx.Response:
        with httpx.Client(timeout=120) as client:
            start.wait()
            return client.post(f"{url}/verify", json=round_body)

    def long_prefill() -> httpx.Response:
        start.wait()
        return post(url, "/prefill", {"prompt": "word " * 900})

    def bystander_rounds() -> list[int]:
        start.wait()
        out, n_past = [], bystander["total_tokens"]
        with httpx.Client(timeout=120) as client:
            while len(out) < BYSTANDER_TOKENS:
                done = len(out)
                # Right drafts, wrong drafts and none, so its trims interleave with the rest.
                draft = expected[done : done + 3] if done % 2 == 0 else [7, 7]
                body = {
                    "session_id": bystander["session_id"],
                    "n_past": n_past,
                    "draft_tokens": draft[: BYSTANDER_TOKENS - 1 - done],
                }
                response = client.post(f"{url}/verify", json=body)
                assert response.status_code == 200, response.text
                out += response.json()["tokens"]
                n_past = response.json()["total_tokens"]
        return out[:BYSTANDER_TOKENS]

    # Everything at once: the duplicates, the bystander's rounds and a long prompt in
    # chunks; whatever order they reach the engine in, the assertions hold.
    with ThreadPoolExecutor(DUPLICATES + 2) as pool:
        prefill = pool.submit(long_prefill)
        watcher = pool.submit(bystander_rounds)
        answers = list(pool.map(duplicate, range(DUPLICATES)))

    assert [a.status_code for a in answers] == [200] * DUPLICATES, [a.text for a in answers]
    bodies = [a.json() for a in answers]
    assert all(body == bodies[0] for body in bodies)  # the very answer, timings included
    assert bodies[0]["tokens"] == reference.json()["tokens"][:5]
    assert bodies[0]["total_tokens"] == target["total_tokens"] + 5
    assert watcher.result() == expected
    assert prefill.result().status_code == 200, prefill.result().text

    # The target session goes on from the one committed round, exactly as the verifier.
    step = post(url, "/verify", {**round_body, "n_past": bodies[0]["total_tokens"]})
    assert step.status_code == 200
    for session in (target, bystander, prefill.result().json()):
        assert httpx.delete(f"{url}/sessions/{session['session_id']}").status_code == 204


def test_deletes_racing_rounds_never_break_another_session(live_verifier):
    """A round and a DELETE of one session sent at once, twice over, a bystander decoding
    beside them: the round is answered whole or finds the session gone, the DELETE always
    succeeds, and the bystander's output is exactly the verifier's own."""
    url = live_verifier.url
    prompt = {"prompt": "def merge_sort(items):\n"}
    expected = post(url, "/generate", {**prompt, "max_tokens": 16}).json()["tokens"]
    bystander = post(url, "/prefill", prompt).json()
    doomed = [post(url, "/prefill", {"prompt": f"Dear Sir or Madam {i},"}).json() for i in (1, 2)]
    start = threading.Barrier(5)

    def round_of(session: dict) -> httpx.Response:
        start.wait()
        body = {"session_id": session["session_id"], "n_past": session["total_tokens"]}
        return post(url, "/verify", {**body, "draft_tokens": [11, 12, 13]})

    def delete(session: dict) -> int:
        start.wait()
        return httpx.delete(f"{url}/sessions/{session['session_id']}", timeout=120).status_code

    def steady() -> list[int]:
        start.wait()
        out, n_past = [], bystander["total_tokens"]
        while len(out) < 16:
            body = {"session_id": bystander["session_id"], "n_past": n_past}
            response = post(url, "/verify", body)
            assert response.status_code == 200, response.text
            out += response.json()["tokens"]
            n_past = response.json()["total_tokens"]
        return out

    with ThreadPoolExecutor(5) as pool:
        rounds = [pool.submit(round_of, session) for session in doomed]
        deletes = [pool.submit(delete, session) for session in doomed]
        watcher = pool.submit(steady)
        assert watcher.result() == expected
        assert [d.result() for d in deletes] == [204, 204]
        for answer in (r.result() for r in rounds):
            assert answer.status_code in (200, 404), answer.text
            if answer.status_code == 200:
                assert answer.json()["timings"]["decoded_tokens"] == 4
    for session in doomed:
        gone = post(url, "/verify", {"session_id": session["session_id"], "n_past": 1})
        assert gone.status_code == 404
    assert httpx.delete(f"{url}/sessions/{bystander['session_id']}").status_code == 204
