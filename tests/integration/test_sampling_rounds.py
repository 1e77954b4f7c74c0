"""Lossless speculative sampling across rounds, on the real models over HTTP: drafts made
while a round is out, and a round without a draft before a drafted one. The first two
tokens and the third must follow the verifier's exact distributions (computed from its
logits; tests/fixtures/sampling.py). Apart from test_sampling.py so that the two files'
long runs go side by side on two test workers."""

from __future__ import annotations

import pytest

from drafter.client import VerifierClient
from tests.fixtures.sampling import RUNS, chi_square_pvalue, first_tokens
from tests.fixtures.scripted_length import ScriptedLength

pytestmark = pytest.mark.integration


def test_pipelined_drafts_keep_sampling_exact(
    live_verifier, draft_model, prompt_ids, exact_joint, exact_third
):
    """Pipelined, the third token's draft was drawn while the first round was out, after
    the drafter's guess of the second token: when the guess came true that draft is
    sent. The first two tokens and the third must still follow the verifier."""
    pairs: dict[tuple[int, int], int] = {}
    thirds: dict[int, int] = {}
    reused = 0
    with VerifierClient(live_verifier.url) as client:
        for seed in range(RUNS):
            tokens, stats = first_tokens(
                client, draft_model, prompt_ids, "rejection", seed, n=4, pipeline=True
            )
            pairs[tokens[:2]] = pairs.get(tokens[:2], 0) + 1
            thirds[tokens[2]] = thirds.get(tokens[2], 0) + 1
            reused += stats.reused_drafts
    assert reused > RUNS // 10, "the pipelined path was hardly taken"
    assert set(pairs) <= set(exact_joint) and set(thirds) <= set(exact_third)
    for counts, exact in ((pairs, exact_joint), (thirds, exact_third)):
        pvalue = chi_square_pvalue(counts, exact, RUNS)
        assert pvalue > 1e-3, (pvalue, counts)


def test_a_chunk_then_a_draft_keeps_sampling_exact(
    live_verifier, draft_model, prompt_ids, exact_joint, exact_third
):
    """A round without a draft that asks for two of the verifier's own tokens, then a
    round with a draft (what `auto` switches between): the first two tokens, sampled by
    the verifier in the chunk, and the third, judged against a draft, follow the verifier."""
    runs = RUNS // 2  # each run is three rounds: half the draws keep the suite's time
    pairs: dict[tuple[int, int], int] = {}
    thirds: dict[int, int] = {}
    with VerifierClient(live_verifier.url) as client:
        for seed in range(runs):
            script = ScriptedLength([(0, 2), (1, 1)])
            tokens, stats = first_tokens(
                client, draft_model, prompt_ids, "rejection", seed, n=4, draft_n=script
            )
            assert stats.tokens_without_draft >= 2  # the chunk, and maybe a last round
            pairs[tokens[:2]] = pairs.get(tokens[:2], 0) + 1
            thirds[tokens[2]] = thirds.get(tokens[2], 0) + 1
    assert set(pairs) <= set(exact_joint) and set(thirds) <= set(exact_third)
    for counts, exact in ((pairs, exact_joint), (thirds, exact_third)):
        pvalue = chi_square_pvalue(counts, exact, runs)
        assert pvalue > 1e-3, (pvalue, counts)
