"""Lossless speculative sampling with drafts made while a round is out, on the real models
over HTTP: the first four tokens must follow the verifier's exact distributions (computed
from its logits; tests/fixtures/sampling.py). Apart from test_sampling.py so that the two
files' long runs go side by side on two test workers."""

from __future__ import annotations

import pytest

from drafter.client import VerifierClient
from tests.fixtures.sampling import ENDED, RUNS, chi_square_pvalue, first_tokens

pytestmark = pytest.mark.integration


def test_pipelined_drafts_keep_sampling_exact(
    live_verifier, draft_model, prompt_ids, exact_joint, exact_third, exact_fourth
):
    """Pipelined, a round's draft was drawn while the round before was out, after the
    drafter's guess of that round's answer: when the guess came true that draft is sent.
    Most such drafts are judged at the fourth token (the first round often brings two),
    some at the third. The first two tokens, the third and the fourth must still follow
    the verifier."""
    pairs: dict[tuple[int, int], int] = {}
    thirds: dict[int, int] = {}
    fourths: dict[int, int] = {}
    reused = 0
    with VerifierClient(live_verifier.url) as client:
        for seed in range(RUNS):
            tokens, stats = first_tokens(
                client, draft_model, prompt_ids, "rejection", seed, n=4, pipeline=True
            )
            pairs[tokens[:2]] = pairs.get(tokens[:2], 0) + 1
            thirds[tokens[2]] = thirds.get(tokens[2], 0) + 1
            fourth = tokens[3] if len(tokens) > 3 else ENDED  # an end of text at the third
            fourths[fourth] = fourths.get(fourth, 0) + 1
            reused += stats.reused_drafts
    assert reused > RUNS // 10, "the pipelined path was hardly taken"
    assert set(pairs) <= set(exact_joint) and set(thirds) <= set(exact_third)
    assert set(fourths) <= set(exact_fourth)
    for counts, exact in ((pairs, exact_joint), (thirds, exact_third), (fourths, exact_fourth)):
        pvalue = chi_square_pvalue(counts, exact, RUNS)
        assert pvalue > 1e-3, (pvalue, counts)
