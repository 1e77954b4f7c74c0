"""The verifier's advised draft length: pure functions of the acceptance, what a pass
costs and how many sessions share one."""

from __future__ import annotations

import pytest

from server.verifier.advice import (
    Acceptance,
    PassCost,
    advised_draft,
    expected_tokens,
)


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 4) == pytest.approx(1.0)
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 3) == pytest.approx(4.0, rel=0.01)  # capped below 1


@pytest.mark.parametrize("acceptance", [0.3, 0.75, 0.95])
def test_where_a_pass_costs_no_more_than_its_rows_drafting_never_pays(acceptance):
    """E(k) / (k + 1) < 1 for every k > 0: a CPU's advice is 0 whatever the drafter."""
    assert advised_draft(acceptance, fixed_rows=0.0, sharing=1.0, max_draft=16) == 0


def test_where_a_pass_costs_many_rows_the_advice_grows_with_the_acceptance():
    low = advised_draft(0.5, fixed_rows=40.0, sharing=1.0, max_draft=16)
    high = advised_draft(0.9, fixed_rows=40.0, sharing=1.0, max_draft=16)
    assert 0 < low < high <= 16


def test_sessions_sharing_passes_make_the_advice_shorter():
    """Loaded, a session pays only its share of each pass's fixed part: the rows of its
    own draft weigh more, and the server's goodput wants shorter drafts."""
    alone = advised_draft(0.8, fixed_rows=40.0, sharing=1.0, max_draft=16)
    shared = advised_draft(0.8, fixed_rows=40.0, sharing=16.0, max_draft=16)
    assert shared < alone


def test_acceptance_counts_rounds_and_ignores_rounds_without_a_draft():
    start = Acceptance()
    assert start.rate == pytest.approx(0.75)
    assert start.after(0, 0) == start
    worse = start.after(4, 0)
    better = start.after(4, 4)
    assert worse.rate < start.rate < better.rate


def test_pass_cost_fits_a_fixed_part_and_a_part_per_row():
    cost = PassCost(prior_fixed_rows=7.0)
    assert cost.fixed_rows == 7.0  # nothing seen yet: the probe's figure
    for rows in (1, 1, 1):
        cost.observe(rows, 0.010 + 0.002 * rows, sessions=1)
    assert cost.fixed_rows == 7.0  # one size only: the line is not known yet
    for rows in (5, 9, 17, 3):
        cost.observe(rows, 0.010 + 0.002 * rows, sessions=1)
    fixed, per_row = cost.line()
    assert fixed == pytest.approx(0.010) and per_row == pytest.approx(0.002)
    assert cost.fixed_rows == pytest.approx(5.0)


def test_rows_that_cost_nothing_make_the_fixed_part_all():
    cost = PassCost(prior_fixed_rows=0.0)
    for rows in (1, 4, 8, 16):
        cost.observe(rows, 0.020, sessions=1)
    assert cost.advise(Acceptance(), max_draft=16) == 16


def test_sharing_follows_the_sessions_in_recent_passes():
    cost = PassCost(prior_fixed_rows=40.0)
    alone = cost.advise(Acceptance(9.0, 1.0), max_draft=16)
    for _ in range(300):
        cost.observe(64, 0.05, sessions=16)
    assert cost.sharing > 10
    assert cost.advise(Acceptance(9.0, 1.0), max_draft=16) < alone
