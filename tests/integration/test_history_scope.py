"""A history is one principal's: a client of a `serve` that others reach cannot learn
another's text by guessing it and reading how much of its own answer was drafted.

The attack ("When Speculation Spills Secrets"): A's prompt ends in a PIN; B knows the
text before it and guesses. The right guess is A's prompt again, and where B's requests
are drafted from a history that holds A's, A's answer is drafted from it and accepted:
the guess stands out in B's `speculative` figures. A stop sequence (never met) paces the
chunks as a watched generation's, as in test_openai_api.py's history test, so that a
history draft goes where it would. The figures are compared as the attacker compares
them: the right guess against the wrong ones, with room for the draft model's own.

The verifier's cached prefixes tell too: B's first guess shares all but the PIN with A's
prompt, and its `cached_tokens` would say so. They are one principal's as the history
is: `serve` names each client key's scope in its prefills (docs/serve.md)."""

from __future__ import annotations

import httpx
import pytest

from scripts.harness.local import LocalServe
from tests.conftest import TEST_THREADS

KNOWN = (
    "Front desk memo, confidential. The door code that Dana Whitfield uses for the "
    "north lab this week is"
)
SECRET = "482915"
WRONG = ["137052", "905418", "482916"]
MAX_TOKENS = 16
# A history draft of A's answer is most of it accepted; a chance draft of the model's a
# few tokens at most on a machine where the model steps aside, and as many for every
# guess where it does not.
MARGIN = 4
# What a history draft earns, fixed: the suffix drafter (no draft model, whose own drafts
# would blur the figures), a verifier that verifies a lookup's draft whole
# (unsized_verifier) and a fixed draft length, where a measured cost of a pass (which a
# loaded machine moves) would size the draft or step aside.
FIXED = ("--drafter", "suffix", "--draft-n", "8")


def completion(serve: LocalServe, key: str, prompt: str) -> dict:
    response = httpx.post(
        f"{serve.url}/completions",
        headers={"authorization": f"Bearer {key}"},
        json={
            "model": "any",
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stop": ["<never>"],
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()


def speculative(serve: LocalServe, key: str, prompt: str) -> dict:
    return completion(serve, key, prompt)["speculative"]


def cached(answer: dict) -> int:
    """The prompt tokens the verifier took from a cached prefix."""
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def guesses(serve: LocalServe, key: str) -> tuple[dict, list[dict]]:
    """B's answers to the right guess and to the wrong ones, the first wrong one first."""
    wrong = [completion(serve, key, f"{KNOWN} {pin}") for pin in WRONG[:2]]
    right = completion(serve, key, f"{KNOWN} {SECRET}")
    wrong.append(completion(serve, key, f"{KNOWN} {WRONG[2]}"))
    return right, wrong


def assert_unrecoverable(right: dict, wrong: list[dict]) -> None:
    """The right guess does not stand out: no history draft of A's answer."""
    for figure in ("drafted", "accepted"):
        most = max(w["speculative"][figure] for w in wrong)
        assert right["speculative"][figure] < most + MARGIN, (figure, right, wrong)


@pytest.fixture(scope="module")
def shared_key_serve(unsized_verifier):
    """One key for the whole team, on loopback: the red team's setup."""
    serve = LocalServe(
        unsized_verifier.url, "--serve-api-key", "sk-team", *FIXED, threads=TEST_THREADS,
        timeout=120,
    )  # fmt: skip
    yield serve
    serve.stop()


def test_a_shared_key_serve_drafts_no_client_from_anothers_text(shared_key_serve):
    first = speculative(shared_key_serve, "sk-team", f"{KNOWN} {SECRET}")  # A
    right, wrong = guesses(shared_key_serve, "sk-team")  # B, the same key
    assert_unrecoverable(right, wrong)
    # One key is one principal, whose clients share the caches (docs/serve.md): B's first
    # guess starts from A's prompt on the verifier.
    assert cached(wrong[0]) > 0, wrong[0]["usage"]
    # Nor from its own earlier request: no history across requests at all by default
    # here. The same prompt a third time drafts as the first did, bar the model's own.
    again = speculative(shared_key_serve, "sk-team", f"{KNOWN} {SECRET}")
    assert again["accepted"] < first["accepted"] + MARGIN, (first, again)


def test_with_scope_key_each_key_drafts_from_its_own_history_only(unsized_verifier):
    serve = LocalServe(
        unsized_verifier.url,
        *FIXED,
        "--serve-api-key",
        "sk-dana,sk-mallory",
        "--history-scope",
        "key",
        threads=TEST_THREADS,
        timeout=120,
    )
    try:
        first_answer = completion(serve, "sk-dana", f"{KNOWN} {SECRET}")
        right, wrong = guesses(serve, "sk-mallory")
        again_answer = completion(serve, "sk-dana", f"{KNOWN} {SECRET}")
    finally:
        serve.stop()
    first, again = first_answer["speculative"], again_answer["speculative"]
    right_figures = right["speculative"]
    assert_unrecoverable(right, wrong)
    # Nor from the caches: Mallory's first guess, all but the PIN Dana's prompt, starts
    # from nothing of Dana's on the verifier; her later guesses from her own, and Dana's
    # repeat from Dana's, whose prefix Mallory's requests did not take.
    assert cached(wrong[0]) == 0 and cached(right) > 0, (wrong[0]["usage"], right["usage"])
    assert cached(again_answer) >= cached(right), (again_answer["usage"], right["usage"])
    # The same prompt from the key that sent it before drafts its answer from that
    # key's history: what the other key's right guess did not get.
    assert again["drafted"] > 0 and again["accepted"] >= first["accepted"] + MARGIN
    assert again["accepted"] >= right_figures["accepted"] + MARGIN, (again, right_figures)
