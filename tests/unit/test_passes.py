"""How rounds are shaped into forward passes (pure): the planner's choices, and the mirror
of how llama.cpp cuts a decode into passes."""

from __future__ import annotations

import pytest

from server.shared.batching import forward_passes
from server.verifier.decoding.passes import PassPlan, plan_passes, plan_pinned


def rows_in_order(plan_rows: dict[int, int]) -> list[int]:
    return [seq for seq, rows in plan_rows.items() for _ in range(rows)]


# -- llama.cpp's split, mirrored --------------------------------------------------------


def test_consecutive_ids_with_equal_rows_are_one_pass():
    assert forward_passes(rows_in_order({0: 5, 1: 5, 2: 5, 3: 5}), 512) == [20]


def test_a_gap_in_the_ids_or_a_shuffled_order_splits_the_decode():
    assert forward_passes(rows_in_order({0: 5, 2: 5}), 512) == [5, 5]
    assert forward_passes(rows_in_order({1: 5, 0: 5}), 512) == [5, 5]  # ids must rise


def test_unequal_rows_are_cut_to_the_shortest_then_the_rest():
    # Two rows of each of the four; one more of 0, 1, 2; then 0 and 2 apart (no longer
    # neighbours, with 1 done).
    assert forward_passes(rows_in_order({0: 5, 1: 3, 2: 5, 3: 2}), 512) == [8, 3, 2, 2]


def test_a_pass_holds_at_most_n_ubatch_rows():
    assert forward_passes(rows_in_order({0: 10}), 4) == [4, 4, 2]


# -- the planner -------------------------------------------------------------------------


def test_rounds_of_neighbouring_sessions_share_one_pass_padded_to_the_widest():
    plans = plan_passes({0: 5, 1: 3, 2: 5}, max_rows=100, pass_cost_rows=6)
    assert plans == [PassPlan(0, 2, 5, (0, 1, 2))]
    assert plans[0].rows == 15


def test_where_a_pass_costs_nothing_measurable_rounds_that_pad_nothing_still_share_one():
    # No padding either way: a tie, and every pass has some cost.
    assert plan_passes({0: 1, 1: 1, 2: 1, 3: 1}, max_rows=100, pass_cost_rows=0.0) == [
        PassPlan(0, 3, 1, (0, 1, 2, 3))
    ]


def test_a_small_gap_is_filled_and_a_large_one_splits_as_the_cost_says():
    # One sequence between them: 5 filler rows cost less than a pass of 6.
    assert plan_passes({0: 5, 2: 5}, max_rows=100, pass_cost_rows=6) == [PassPlan(0, 2, 5, (0, 2))]
    # Six between them: 30 filler rows cost more than a pass.
    assert plan_passes({0: 5, 7: 5}, max_rows=100, pass_cost_rows=6) == [
        PassPlan(0, 0, 5, (0,)),
        PassPlan(7, 7, 5, (7,)),
    ]
    # Where a pass costs far more than rows (a GPU), everything shares one.
    assert plan_passes({0: 5, 7: 5}, max_rows=100, pass_cost_rows=500) == [
        PassPlan(0, 7, 5, (0, 7))
    ]


def test_no_pass_is_wider_than_the_probe_proved():
    plans = plan_passes({s: 9 for s in range(8)}, max_rows=36, pass_cost_rows=1000)
    assert all(plan.rows <= 36 for plan in plans)
    assert sorted(s for plan in plans for s in plan.jobs) == list(range(8))
    with pytest.raises(ValueError):
        plan_passes({0: 40}, max_rows=36, pass_cost_rows=0)


@pytest.mark.parametrize("cost", [0.0, 3.0, 30.0, 1e6])
def test_every_plan_is_one_forward_pass_per_decode(cost):
    jobs = {0: 3, 1: 9, 3: 1, 4: 4, 6: 9, 7: 2}
    for plan in plan_passes(jobs, max_rows=72, pass_cost_rows=cost):
        order = [s for s in range(plan.first, plan.last + 1) for _ in range(plan.width)]
        assert forward_passes(order, 512) == [plan.rows]
        assert all(jobs[s] <= plan.width for s in plan.jobs)


def test_pinned_passes_span_every_sequence_at_one_width():
    assert plan_pinned({2: 3, 0: 9}, n_seq=4, width=9) == [PassPlan(0, 3, 9, (0, 2))]
    assert plan_pinned({}, n_seq=4, width=9) == []
    with pytest.raises(ValueError):
        plan_pinned({0: 10}, n_seq=4, width=9)
