"""scripts/expect.py's arithmetic: a round's cost and the draft length it picks."""

from __future__ import annotations

import pytest

from scripts.expect import best_round, round_ms
from server.shared.draft_gain import expected_tokens


def test_a_round_costs_its_drafts_the_link_and_its_rows():
    assert round_ms(4, row_ms=10.0, row_cost=0.5, draft_ms=2.0, rtt_ms=3.0) == 8 + 3 + 30


def test_free_drafts_and_rows_take_the_longest_draft():
    k, rate = best_round(0.8, row_ms=10.0, row_cost=0.0, draft_ms=0.0, rtt_ms=0.0)
    assert k == 16 and rate == pytest.approx(100.0 * expected_tokens(0.8, 16))


def test_a_drafter_slower_than_the_verifier_never_beats_it():
    _, rate = best_round(0.99, row_ms=4.0, row_cost=0.0, draft_ms=8.0, rtt_ms=1.0)
    assert rate < 1000.0 / 4.0
