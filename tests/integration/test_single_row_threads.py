"""A lone row past 256 cells with more than one thread (docs/numerics.md, "Threads"):
llama.cpp's CPU flash attention then splits the row's keys between threads and sums the
parts in another order than a pass of more rows does, so the verifier alone would not
decode what a round decodes. The startup probe checks a round after a long context, and
the verifier computes a pass of one row with one thread; a verifier of two threads then
answers token for token as llama-cpp-python's decoder of one thread, alone and through
speculative rounds."""

from __future__ import annotations

import httpx
import pytest

from server.shared.protocol import PrefillRequest
from server.shared.runtime import LlamaRuntime
from server.verifier.decoding.decoder import PassDecoder
from server.verifier.decoding.passes import PassShapes
from server.verifier.probe import invariance
from tests.conftest import ReferenceDecoder, start_verifier
from tests.fixtures.speculate import speculate

pytestmark = pytest.mark.integration

ROUND_ROWS = 5
TEXT = (
    "A verifier keeps one cache per session. When the session ends, its cache stays "
    "behind for the same client's next prompt, which evaluates only what is new. "
) * 12  # about 370 tokens: past 256 cells before the first round
MAX_TOKENS = 40


def probe(verifier_model, single_row_threads: int, long_context: int):
    runtime = LlamaRuntime(
        verifier_model,
        n_ctx_per_seq=512,
        n_seq_max=2,
        n_threads=2,
        single_row_threads=single_row_threads,
    )
    try:
        free = PassShapes(n_seq=2, max_rows=2 * ROUND_ROWS, pass_cost_rows=0.0)
        return invariance.probe(
            PassDecoder(runtime),
            free,
            round_rows=ROUND_ROWS,
            pin="off",
            pin_width=ROUND_ROWS,
            prompt_chunks=[512],
            long_context=long_context,
        )
    finally:
        runtime.close()


def test_the_probe_sees_a_lone_row_split_between_threads_past_256_cells(verifier_model):
    # Two threads for every pass: exact at the short context, not after the long one.
    assert probe(verifier_model, 2, long_context=0).batch_invariant is True
    split = probe(verifier_model, 2, long_context=invariance.LONG_CONTEXT)
    assert split.batch_invariant is False and split.max_abs_diff > 0
    # A pass of one row with one thread: exact after the long context too.
    one = probe(verifier_model, 1, long_context=invariance.LONG_CONTEXT)
    assert one.batch_invariant is True and one.max_abs_diff == 0


@pytest.fixture(scope="module")
def two_threads(verifier_model):
    verifier = start_verifier(verifier_model, n_threads=2, max_sessions=2, max_draft=4)
    yield verifier
    verifier.stop()


def test_two_threads_answer_as_one_alone_and_through_rounds(
    two_threads, verifier_model, drafter_model
):
    url = two_threads.url
    info = httpx.get(f"{url}/info", timeout=30).json()
    # Exact in free shapes: without one thread for a lone row the probe would pin them.
    assert info["batch_invariant"] is True and info["pinned_width"] == 0
    opened = httpx.post(f"{url}/prefill", json={"prompt": TEXT}, timeout=300).json()
    httpx.delete(f"{url}/sessions/{opened['session_id']}", timeout=30)
    prompt_ids = opened["prompt_ids"]
    assert len(prompt_ids) > 256
    reference = ReferenceDecoder(verifier_model, info["prompt_chunk"], info["prompt_tile_rows"])
    expected = reference.greedy(prompt_ids, MAX_TOKENS)

    alone = httpx.post(
        f"{url}/generate",
        json={"prompt_tokens": prompt_ids, "max_tokens": MAX_TOKENS},
        timeout=300,
    ).json()["tokens"]
    assert alone == expected

    _, result = speculate(url, drafter_model, PrefillRequest(prompt_tokens=prompt_ids),
                          MAX_TOKENS, draft_n=4)  # fmt: skip
    assert result.tokens == expected
    assert result.lossless is True
