"""Numbers that cannot overflow: for any accepted sampling parameters and any finite logits
the distributions are finite and sum to one, and rejection sampling's output law is the
target's, whatever the drafter's q. Properties over generated inputs (Hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from pydantic import ValidationError

from server.shared.acceptance import acceptance_probability, residual_distribution
from server.shared.protocol import MIN_TEMPERATURE, SamplingParams
from server.shared.sampling import cap_support, dense, probabilities, sparse

VOCAB = 24
finite_logits = arrays(
    np.float32,
    VOCAB,
    elements=st.floats(allow_nan=False, allow_infinity=False, width=32),
)
temperatures = st.one_of(
    st.just(0.0),
    st.floats(MIN_TEMPERATURE, 100.0),
    st.sampled_from([MIN_TEMPERATURE, 1e-4, 1.0, 100.0]),
)
sampling_params = st.builds(
    SamplingParams,
    temperature=temperatures,
    top_k=st.integers(0, VOCAB + 3),
    top_p=st.floats(1e-9, 1.0, exclude_min=False),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
)


def distribution(size: int = VOCAB):
    """Arbitrary distributions over `size` tokens, zeros included."""
    weights = arrays(np.float64, size, elements=st.floats(0.0, 1.0))
    return weights.filter(lambda w: w.sum() > 1e-6).map(lambda w: w / w.sum())


@given(finite_logits, sampling_params)
@settings(max_examples=400, deadline=None)
def test_any_accepted_parameters_give_a_finite_distribution(logits, sampling):
    probs = probabilities(logits, sampling)
    assert np.isfinite(probs).all() and (probs >= 0).all()
    assert probs.sum() == pytest.approx(1.0, abs=1e-9)
    if sampling.top_k:
        assert np.count_nonzero(probs) <= max(sampling.top_k, 1) or sampling.top_k >= VOCAB
    if sampling.greedy:
        assert probs[int(np.argmax(logits))] == 1.0


@given(finite_logits, sampling_params)
@settings(max_examples=200, deadline=None)
def test_a_masked_token_gets_no_mass(logits, sampling):
    logits = logits.copy()
    logits[-3:] = -np.inf  # a drafter's ids beyond a compatible verifier's vocabulary
    probs = probabilities(logits, sampling)
    assert np.isfinite(probs).all() and probs[-3:].sum() == 0.0


@given(st.floats(0.0, MIN_TEMPERATURE, exclude_min=True, exclude_max=True))
def test_a_denormal_temperature_is_refused(temperature):
    with pytest.raises(ValidationError):
        SamplingParams(temperature=temperature)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 101.0, 1e-310])
def test_temperatures_out_of_range_are_refused(bad):
    with pytest.raises(ValidationError):
        SamplingParams(temperature=bad)


@given(distribution(), distribution())
@settings(max_examples=300, deadline=None)
def test_rejection_sampling_follows_the_target_whatever_the_draft(target, draft):
    """One draft position, computed exactly: the draft token x ~ q is kept with
    min(1, p(x)/q(x)), else the recovered token comes from norm(max(0, p - q)). The
    committed token's law is p (Leviathan et al., Theorem 1)."""
    accept = np.array(
        [acceptance_probability(target[x], draft[x]) for x in range(VOCAB)], dtype=np.float64
    )
    kept = draft * accept
    rejected = 1.0 - kept.sum()
    law = kept + rejected * residual_distribution(target, draft)
    assert np.isfinite(law).all()
    assert law == pytest.approx(target, abs=1e-9)


@given(distribution(), st.integers(1, VOCAB))
@settings(max_examples=200, deadline=None)
def test_a_capped_q_sent_as_sparse_pairs_is_the_same_q(q, max_support):
    capped = cap_support(q, max_support)
    assert np.isfinite(capped).all() and capped.sum() == pytest.approx(1.0)
    assert np.count_nonzero(capped) <= max_support
    assert dense(sparse(capped), VOCAB) == pytest.approx(capped)
