"""Penalties and biases on a round's rows, and the logprobs shown: pure, on small rows."""

from __future__ import annotations

import numpy as np
import pytest

from server.shared.penalties import adjusted_rows, token_logprobs
from server.shared.protocol import SamplingParams


def rows(n: int, vocab: int = 6) -> np.ndarray:
    return np.zeros((n, vocab), dtype=np.float32)


def test_nothing_to_adjust_leaves_the_logits_as_they_are():
    logits = rows(3)
    assert adjusted_rows(logits, SamplingParams(), [1, 2], [3, 4]) is logits


def test_each_row_counts_the_generated_tokens_and_the_drafts_before_it():
    """Row i follows the generated tokens and the first i drafts: it is used only if those
    were accepted, so it is penalised as if they were."""
    sampling = SamplingParams(presence_penalty=0.5, frequency_penalty=1.0)
    out = adjusted_rows(rows(3), sampling, generated=[2, 2], draft_tokens=[3, 2])
    assert out[0].tolist() == [0, 0, -2.5, 0, 0, 0]  # 2 twice: 2 * 1.0 + 0.5
    assert out[1].tolist() == [0, 0, -2.5, -1.5, 0, 0]  # and the first draft, 3
    assert out[2].tolist() == [0, 0, -3.5, -1.5, 0, 0]  # and the second, 2 again


def test_the_prompt_is_not_penalised_and_a_bias_applies_to_every_row():
    sampling = SamplingParams(logit_bias={1: -100.0, 5: 2.5}, presence_penalty=1.0)
    out = adjusted_rows(rows(2), sampling, generated=[], draft_tokens=[5])
    assert out[0].tolist() == [0, -100, 0, 0, 0, 2.5]
    assert out[1].tolist() == [0, -100, 0, 0, 0, 1.5]  # 5 was drafted: present


def test_a_negative_penalty_encourages_repeats():
    out = adjusted_rows(rows(1), SamplingParams(frequency_penalty=-2.0), [4, 4, 4], [])
    assert int(np.argmax(out[0])) == 4


def test_logprobs_are_the_log_softmax_with_the_likeliest_first():
    row = np.log(np.array([0.1, 0.2, 0.3, 0.4], dtype=np.float32))
    logprob, top = token_logprobs(row, 1, top=2)
    assert logprob == pytest.approx(np.log(0.2), abs=1e-6)
    assert [t for t, _ in top] == [3, 2]
    assert top[0][1] == pytest.approx(np.log(0.4), abs=1e-6)
    assert token_logprobs(row, 0, top=0)[1] == []


def test_ties_in_the_top_are_broken_by_token_id():
    _, top = token_logprobs(np.zeros(5, dtype=np.float32), 0, top=3)
    assert [t for t, _ in top] == [0, 1, 2]
