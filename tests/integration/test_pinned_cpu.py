"""Pinned pass shapes on the real model, at the width where this CPU's kernels change
(flash attention takes its tiled path from 64 rows of a sequence): every decode of every
sequence is 64 rows, prompt chunks, rounds and /generate's steps alike, and greedy
speculative output is still the verifier's own, token for token."""

from __future__ import annotations

import httpx
import pytest

from drafter.client import VerifierClient
from drafter.drafters.model import DraftModel
from drafter.speculative.loop import SpeculativeLoop
from server.shared.protocol import PrefillRequest
from tests.conftest import TEST_THREADS, start_verifier

pytestmark = pytest.mark.integration

PIN_WIDTH = 64
TOKENS = 20
PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def pinned_verifier(verifier_model):
    verifier = start_verifier(
        verifier_model,
        pin_shapes="on",
        pin_width=PIN_WIDTH,
        max_sessions=2,
        max_draft=4,
        n_ctx=256,
    )
    yield verifier
    verifier.stop()


def test_pinned_at_64_rows_greedy_speculation_is_the_verifiers_own(pinned_verifier, drafter_model):
    url = pinned_verifier.url
    info = httpx.get(f"{url}/info").json()
    assert info["pinned_width"] == PIN_WIDTH and info["batch_invariant"] is True
    assert info["prompt_chunk"] == PIN_WIDTH
    expected = httpx.post(
        f"{url}/generate", json={"prompt": PROMPT, "max_tokens": TOKENS}, timeout=600
    ).json()["tokens"]
    model = DraftModel(drafter_model, n_ctx=512, n_threads=TEST_THREADS)
    try:
        with VerifierClient(url, timeout=600) as client:
            loop = SpeculativeLoop(model, client, draft_n=4, n_ctx=info["n_ctx"])
            for _ in loop.run(PrefillRequest(prompt=PROMPT), TOKENS):
                pass
    finally:
        model.close()
    assert loop.result.tokens == expected
    assert loop.result.lossless is True
