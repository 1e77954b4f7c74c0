"""Rejection sampling and sample-and-match emit tokens distributed exactly as p.

Checked exactly by enumeration where the rule's pieces allow it, and by a chi-square test
over many seeded draws of the whole function (after vLLM's
test_rejection_sampling_approximates_target_distribution).
"""

import numpy as np
import pytest
from scipy.stats import chisquare

from server.shared.acceptance import (
    accept_match,
    accept_rejection,
    accept_threshold,
    acceptance_probability,
    residual_distribution,
)
from server.shared.protocol import SamplingParams
from server.shared.sampling import (
    PositionDraws,
    cap_support,
    dense,
    probabilities,
    sample,
    sparse,
)

V = 6
EOS = 5


def is_eog(token: int) -> bool:
    return token == EOS


def one_stream(rng: np.random.Generator):
    """Every row's draws from one stream, in the order the rule takes them: many verdicts
    from one seed."""
    return lambda _: rng


def dist(*values: float) -> np.ndarray:
    probs = np.array(values, dtype=np.float64)
    return probs / probs.sum()


CASES = {
    "overlap": (dist(4, 3, 2, 1, 0, 0), dist(1, 2, 3, 2, 2, 0)),
    "disjoint": (dist(5, 5, 0, 0, 0, 0), dist(0, 0, 3, 3, 4, 0)),
    "q_equals_p": (dist(1, 2, 3, 4, 0, 0), dist(1, 2, 3, 4, 0, 0)),
    "q_one_token": (dist(2, 1, 1, 1, 1, 0), dist(0, 0, 1, 0, 0, 0)),
    "p_one_token": (dist(0, 0, 0, 1, 0, 0), dist(1, 1, 1, 1, 1, 0)),
}


def rejection_first_token_exact(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """P(first committed token = y) = sum_x q(x) [a(x) 1{y=x} + (1 - a(x)) r(y)]."""
    out = np.zeros(V)
    residual = residual_distribution(p, q)
    for x in range(V):
        if q[x] == 0:
            continue
        a = acceptance_probability(p[x], q[x])
        out[x] += q[x] * a
        out += q[x] * (1 - a) * residual
    return out


@pytest.mark.parametrize("case", CASES)
def test_rejection_rule_is_exactly_p_by_enumeration(case):
    p, q = CASES[case]
    np.testing.assert_allclose(rejection_first_token_exact(p, q), p, atol=1e-12)


def first_tokens(strategy: str, p: np.ndarray, q: np.ndarray, n: int, seed: int) -> np.ndarray:
    """The first token of `n` generations, each seeded (`seed` + its number) and drawing
    as the verifier does, by position."""
    draft_rng = np.random.default_rng(seed + 1)
    p_next = dist(1, 1, 1, 1, 1, 1)
    counts = np.zeros(V)
    for run in range(n):
        draws = PositionDraws(seed + run).at
        x = sample(q, draft_rng)
        target = np.stack([p, p_next])
        if strategy == "rejection":
            verdict = accept_rejection([x], [q], target, draws, is_eog)
        else:
            verdict = accept_match([x], target, draws, is_eog)
        counts[verdict.tokens[0]] += 1
    return counts


@pytest.mark.parametrize("strategy", ["rejection", "match"])
@pytest.mark.parametrize("case", CASES)
def test_emitted_token_follows_p_chi_square(strategy, case):
    p, q = CASES[case]
    n = 6000
    counts = first_tokens(strategy, p, q, n, seed=1234)
    support = p > 0
    assert counts[~support].sum() == 0  # never a token p excludes
    if support.sum() > 1:
        result = chisquare(counts[support], n * p[support])
        assert result.pvalue > 1e-3, (counts, n * p)


def test_bonus_token_follows_the_last_row_when_all_are_accepted():
    p0 = dist(0, 1, 0, 0, 0, 0)  # the draft token 1 is always accepted
    p1 = dist(1, 2, 3, 4, 0, 0)
    rng = np.random.default_rng(7)
    counts = np.zeros(V)
    for _ in range(5000):
        verdict = accept_rejection([1], [p0], np.stack([p0, p1]), one_stream(rng), is_eog)
        assert verdict.accepted_prefix_len == 1
        counts[verdict.tokens[1]] += 1
    support = p1 > 0
    assert chisquare(counts[support], 5000 * p1[support]).pvalue > 1e-3


def test_accepted_eos_ends_the_round():
    p = dist(0, 0, 0, 0, 0, 1)
    draws = PositionDraws(0).at
    verdict = accept_rejection([EOS, 1], [p, p], np.stack([p, p, p]), draws, is_eog)
    assert verdict.tokens == [EOS] and verdict.eos
    verdict = accept_match([EOS, 1], np.stack([p, p, p]), draws, is_eog)
    assert verdict.tokens == [EOS] and verdict.eos


def test_same_seed_same_verdicts():
    p, q = CASES["overlap"]
    target = np.stack([p, p, p])

    def run(seed):
        draws = PositionDraws(seed).at

        def from_position(start: int):
            return lambda i: draws(start + i)

        # Rounds of two drafts, each from the next three positions on.
        rounds = range(0, 150, 3)
        return [
            accept_rejection([0, 1], [q, q], target, from_position(start), is_eog).tokens
            for start in rounds
        ]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_threshold_accepts_likely_drafts_and_is_lossy():
    p = dist(6, 3, 1, 0, 0, 0)
    rng = np.random.default_rng(0)
    verdict = accept_threshold([1, 0], np.stack([p, p, p]), 0.25, one_stream(rng), is_eog)
    assert verdict.accepted_prefix_len == 2
    counts = np.zeros(V)
    for _ in range(3000):
        counts[
            accept_threshold([1], np.stack([p, p]), 0.25, one_stream(rng), is_eog).tokens[0]
        ] += 1
    assert counts[1] == 3000  # p(1) = 0.3: always accepted, so not distributed as p


def test_probabilities_apply_temperature_top_k_top_p():
    logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    full = probabilities(logits, SamplingParams(temperature=1.0))
    np.testing.assert_allclose(full, [0.5, 0.2, 0.15, 0.1, 0.05])
    top2 = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(top2, [0.5 / 0.7, 0.2 / 0.7, 0, 0, 0])
    nucleus = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.8))
    np.testing.assert_allclose(nucleus, np.array([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    hot = probabilities(logits, SamplingParams(temperature=2.0))
    assert hot[4] > full[4]
    greedy = probabilities(logits, SamplingParams(temperature=0.0))
    np.testing.assert_array_equal(greedy, [1, 0, 0, 0, 0])


def test_sparse_dense_roundtrip_and_cap():
    p = dist(4, 3, 2, 1, 0, 0)
    assert [t for t, _ in sparse(p)] == [0, 1, 2, 3]
    np.testing.assert_allclose(dense(sparse(p), V), p)
    capped = cap_support(p, 2)
    np.testing.assert_allclose(capped, dist(4, 3, 0, 0, 0, 0))
    assert cap_support(p, 10) is p


def test_sample_never_draws_outside_the_support():
    p = dist(0, 1, 0, 1, 0, 0)
    rng = np.random.default_rng(0)
    assert {sample(p, rng) for _ in range(500)} == {1, 3}


def reference_probabilities(logits: np.ndarray, sampling: SamplingParams) -> np.ndarray:
    """The transforms written the slow, obvious way: a full sort of the vocabulary."""
    x = logits.astype(np.float64) / sampling.temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    if sampling.top_k:
        order = order[: sampling.top_k]
    cumulative = np.cumsum(p[order] / p[order].sum())
    keep = min(order.size, int(np.searchsorted(cumulative, sampling.top_p)) + 1)
    out = np.zeros_like(p)
    out[order[:keep]] = p[order[:keep]]
    return out / out.sum()


def test_fast_cuts_equal_a_full_sort_on_a_real_sized_vocabulary():
    rng = np.random.default_rng(1)
    for _ in range(40):
        logits = (rng.standard_normal(49152) * rng.uniform(0.5, 8)).astype(np.float32)
        sampling = SamplingParams(
            temperature=float(rng.uniform(0.2, 1.5)),
            top_p=float(rng.choice([0.5, 0.9, 0.95, 0.99, 1.0])),
            top_k=int(rng.choice([0, 0, 5, 40])),
        )
        np.testing.assert_allclose(
            probabilities(logits, sampling), reference_probabilities(logits, sampling), atol=1e-12
        )
