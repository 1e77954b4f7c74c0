"""Lossless speculative sampling on the real models over HTTP.

Over 2,000 seeded runs each, the first two generated tokens must follow the verifier's
exact joint distribution (computed from its logits): for sample-and-match on plain rows,
and for rejection sampling on rows penalised, biased and masked by a grammar all at once
(each adjustment changes the distribution the draft is judged against; a slip in any one
moves the pairs). Over 1,000, a round without a draft before a drafted one keeps the
first three tokens the verifier's. Drafting ahead is in test_sampling_rounds.py. A seed
must reproduce its output; the lossy strategy must say so.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

from drafter.cli import app
from drafter.client import VerifierClient
from drafter.drafters.model import DraftPolicy
from server.shared.grammars import Grammars
from server.shared.penalties import adjusted_rows
from server.shared.protocol import Grammar, PrefillRequest, SamplingParams, VerifyRequest
from tests.conftest import TEST_THREADS
from tests.fixtures.sampling import (
    RUNS,
    chi_square_pvalue,
    first_tokens,
    joint_of_first_two,
    last_logits,
    masked_after,
    sampled_pairs,
    sampling_for,
)
from tests.fixtures.scripted_length import ScriptedLength

pytestmark = pytest.mark.integration


def test_first_two_tokens_follow_the_verifier_distribution_with_match(
    live_verifier, draft_model, prompt_ids, exact_joint
):
    counts = sampled_pairs(live_verifier.url, draft_model, prompt_ids, "match")
    assert set(counts) <= set(exact_joint), "a pair the verifier gives no probability"
    pvalue = chi_square_pvalue(counts, exact_joint, RUNS)
    assert pvalue > 1e-3, (pvalue, counts)


PRESENCE_PENALTY = 1.5
# Lowercase words after a space: the verifier's likeliest first tokens, cut to some of them.
WORDS = Grammar(kind="regex", source=r" [a-m][a-z]*( [a-z]+)*")


@pytest.fixture(scope="module")
def adjusted_joint(verifier_runtime, prompt_ids) -> tuple[dict, dict[tuple[int, int], float]]:
    """A bias against the likeliest first token WORDS allows, a presence penalty and WORDS;
    and P(t1, t2)
    under them, computed here from the verifier model's logits: each row penalised for the
    tokens before it, then masked by the grammar's state after them."""
    runtime = verifier_runtime
    runtime.remove(0, -1)
    row = last_logits(runtime, prompt_ids, 0)
    constraint = Grammars(runtime.grammar_tokenizer, runtime.n_vocab).constraint(
        WORDS.kind, WORDS.source
    )
    # Against the likeliest first token the grammar allows, so that the bias moves the pairs.
    biased = int(np.argmax(masked_after(constraint, [], row)))
    adjusted = {"presence_penalty": PRESENCE_PENALTY, "logit_bias": {biased: -2.0}}
    sampling = sampling_for(None, **adjusted)

    def adjust(logits: np.ndarray, before: list[int]) -> np.ndarray:
        penalised = adjusted_rows(logits[None], sampling, before, [])[0]
        return masked_after(constraint, before, penalised)

    return adjusted, joint_of_first_two(runtime, prompt_ids, sampling, adjust)


def test_penalties_biases_and_a_grammar_keep_rejection_sampling_exact(
    live_verifier, draft_model, prompt_ids, adjusted_joint
):
    """Drafts drawn from the draft model's own distribution, judged by rejection sampling
    against the verifier's rows penalised, biased and masked (the second row penalised for
    the first token and masked by the grammar's state after it, drafted or not): the first
    two tokens follow that distribution."""
    adjusted, exact = adjusted_joint
    counts = sampled_pairs(
        live_verifier.url, draft_model, prompt_ids, adjusted=adjusted, grammar=WORDS
    )
    assert set(counts) <= set(exact), "a pair the adjusted distribution rules out"
    pvalue = chi_square_pvalue(counts, exact, RUNS)
    assert pvalue > 1e-3, (pvalue, counts)


def run_cli(url: str, *args: str) -> dict:
    result = CliRunner().invoke(
        app, ["--server", url, "--output", "json", "--threads", str(TEST_THREADS), *args]
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("strategy", ["rejection", "match", "threshold"])
def test_same_seed_same_output(live_verifier, strategy):
    args = [
        "--prompt",
        "Tell me about owls.",
        "--chat",
        "--max-tokens",
        "32",
        "--temperature",
        "0.9",
        "--top-p",
        "0.95",
        "--strategy",
        strategy,
        "--threshold",
        "0.3",
    ]
    first = run_cli(live_verifier.url, *args, "--seed", "11")
    again = run_cli(live_verifier.url, *args, "--seed", "11")
    other = run_cli(live_verifier.url, *args, "--seed", "12")
    assert first["tokens"] == again["tokens"]
    assert first["tokens"] != other["tokens"]
    assert first["strategy"] == strategy
    assert first["lossless"] is (strategy != "threshold")
    assert first["stats"]["bytes_sent_per_round"] > 0


def test_a_seeded_session_opened_again_draws_on_where_the_first_stood(live_verifier, prompt_ids):
    """A session opened again from its prompt and the tokens generated so far (as a
    drafter does after a restart) goes on with the draws of the positions it is at: the
    rest is what the verifier alone gives with the same seed, in one go."""
    sampling = {"temperature": 1.0, "seed": 5}
    whole = httpx.post(
        f"{live_verifier.url}/generate",
        json={"prompt_tokens": prompt_ids, "max_tokens": 24, "sampling": sampling},
        timeout=120,
    ).json()["tokens"]
    cut = 7
    reopened = PrefillRequest(
        prompt_tokens=prompt_ids + whole[:cut],
        add_bos=False,
        generated_tokens=cut,
        sampling=SamplingParams(**sampling),
    )
    rest: list[int] = []
    with VerifierClient(live_verifier.url) as client:
        session = client.prefill(reopened)
        total = session.total_tokens
        while len(rest) < len(whole) - cut:
            answer = client.verify(VerifyRequest(session_id=session.session_id, n_past=total))
            rest += answer.tokens
            total = answer.total_tokens
            if answer.eos:
                break
        client.delete_session(session.session_id)
    assert rest == whole[cut:]


def test_lossy_strategy_is_flagged_everywhere(live_verifier):
    with VerifierClient(live_verifier.url) as client:
        assert client.info().strategies == {
            "greedy": True,
            "rejection": True,
            "match": True,
            "threshold": False,
        }
        opened = client.prefill(
            PrefillRequest(
                prompt="Hi", sampling=sampling_for(1), strategy="threshold", threshold=0.2
            )
        )
        assert opened.lossless is False
        round_ = client.verify(
            VerifyRequest(
                session_id=opened.session_id, n_past=opened.total_tokens, draft_tokens=[42]
            )
        )
        assert round_.strategy == "threshold" and round_.lossless is False
        client.delete_session(opened.session_id)


def test_rejection_needs_valid_draft_probs(live_verifier):
    with VerifierClient(live_verifier.url) as client:
        opened = client.prefill(PrefillRequest(prompt="Hi", sampling=sampling_for(1)))
    base = {"session_id": opened.session_id, "n_past": opened.total_tokens, "draft_tokens": [42]}
    for extra, error_type in [
        ({}, "invalid_draft_probs"),
        ({"draft_probs": [[[42, 0.5]]]}, "invalid_draft_probs"),
        ({"draft_probs": [[[7, 1.0]]]}, "invalid_draft_probs"),
        ({"draft_probs": [[[42, 1.0]], [[1, 1.0]]]}, "invalid_draft_probs"),
        ({"draft_probs": [[[49152, 1.0]]]}, "invalid_token"),
    ]:
        response = httpx.post(f"{live_verifier.url}/verify", json={**base, **extra})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == error_type
    ok = httpx.post(
        f"{live_verifier.url}/verify", json={**base, "draft_probs": [[[42, 0.25], [43, 0.75]]]}
    )
    assert ok.status_code == 200, ok.text
    httpx.delete(f"{live_verifier.url}/sessions/{opened.session_id}")


def test_a_confidence_cut_never_shortens_a_sampled_draft(draft_model, prompt_ids):
    """A sampled draft stopped by its own value would not be drawn from the q it sends,
    and rejection sampling would follow another law: p_min applies to argmax drafts only."""
    k = 6
    for seed in range(20):
        draft_model.configure(
            DraftPolicy(sampling_for(seed), sample_drafts=True, seed=seed, p_min=0.999)
        )
        draft = draft_model.get_candidates(prompt_ids, k)
        ended = draft.tokens and draft_model.runtime.is_eog(draft.tokens[-1])
        assert len(draft.tokens) == k or ended, (seed, draft.tokens)
    draft_model.configure(DraftPolicy(sampling_for(None), sample_drafts=False, p_min=0.999))
    assert len(draft_model.get_candidates(prompt_ids, k).tokens) < k  # the cut is on
    draft_model.configure(DraftPolicy(sampling_for(None), sample_drafts=False))


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
