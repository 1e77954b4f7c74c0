"""The verifier's advised draft length: pure functions of the acceptance, what a pass
costs and how many sessions share one."""

from __future__ import annotations

import pytest

from server.shared.draft_gain import Acceptance, expected_tokens
from server.verifier.decoding.advice import (
    MAX_FIXED_ROWS,
    Advisor,
    PassCost,
    advised_draft,
    line_seconds,
)


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 4) == pytest.approx(1.0)
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 3) == pytest.approx(4.0, rel=0.01)  # capped below 1


@pytest.mark.parametrize("acceptance", [0.3, 0.75, 0.95])
def test_where_a_pass_costs_no_more_than_its_rows_drafting_never_pays(acceptance):
    """E(k) / (k + 1) < 1 for every k > 0: a CPU's advice is 0 whatever the drafter."""
    assert advised_draft(acceptance, line_seconds(0.0), sharing=1.0, max_draft=16) == 0


def test_where_a_pass_costs_many_rows_the_advice_grows_with_the_acceptance():
    low = advised_draft(0.5, line_seconds(40.0), sharing=1.0, max_draft=16)
    high = advised_draft(0.9, line_seconds(40.0), sharing=1.0, max_draft=16)
    assert 0 < low < high <= 16


def test_sessions_sharing_passes_make_the_advice_shorter():
    """Loaded, a session pays only its share of each pass's fixed part: the rows of its
    own draft weigh more, and the server's goodput wants shorter drafts."""
    alone = advised_draft(0.8, line_seconds(40.0), sharing=1.0, max_draft=16)
    shared = advised_draft(0.8, line_seconds(40.0), sharing=16.0, max_draft=16)
    assert shared < alone


# The shape the startup probe measures on a 2-core CPU: a row alone runs other kernels
# than a row among dozens.
CPU_PROBE = ((1, 0.0093), (5, 0.0425), (80, 0.264))


def test_on_a_cpu_an_idle_verifier_advises_no_draft_and_a_loaded_one_a_draft():
    """Alone, 5 rows cost 4.6 times 1; in a pass of 8 sessions, 16 rows cost far less
    than twice 8: there a draft pays for the server."""
    cost = PassCost(prior_fixed_rows=None, seed=CPU_PROBE)
    assert Advisor(cost).advise(Acceptance(), max_draft=16, last_draft=16) == 0
    for _ in range(200):
        cost.observe(8, 0.050, sessions=8)
    assert cost.sharing > 7.5
    assert Advisor(cost).advise(Acceptance(), max_draft=16, last_draft=16) >= 1
    assert cost.fixed_rows > 1.0


def test_pass_cost_reads_a_curve_between_the_sizes_it_saw():
    cost = PassCost(prior_fixed_rows=7.0)
    assert cost.fixed_rows == 7.0  # nothing seen yet: the probe's figure
    for rows in (1, 1, 1):
        cost.observe(rows, 0.010, sessions=1)
    assert cost.fixed_rows == 7.0  # one size only: the curve is not known yet
    for rows, seconds in ((4, 0.030), (16, 0.070), (64, 0.200)):
        cost.observe(rows, seconds, sessions=1)
    t = cost.seconds()
    assert t(1) == pytest.approx(0.010) and t(16) == pytest.approx(0.070)
    assert t(10) == pytest.approx(0.050)  # between 4 and 16
    assert t(128) == pytest.approx(0.200 + 64 * (0.130 / 48))  # past the last: its slope


def test_passes_of_the_same_size_share_a_point_and_old_ones_fade():
    cost = PassCost(prior_fixed_rows=None, seed=((1, 0.010), (64, 0.200)))
    for _ in range(10):
        cost.observe(16, 0.100, sessions=4)
    assert [round(rows) for rows, _ in cost.points()] == [1, 16, 64]
    for _ in range(400):
        cost.observe(1, 0.010, sessions=1)
    # 16 faded away; the probe's points stay.
    assert [round(rows) for rows, _ in cost.points()] == [1, 64]


def test_no_timings_and_no_prior_mean_no_advice():
    assert (
        Advisor(PassCost(prior_fixed_rows=None)).advise(Acceptance(), max_draft=16, last_draft=16)
        is None
    )


def test_acceptance_counts_rounds_and_ignores_rounds_without_a_draft():
    start = Acceptance()
    assert start.rate == pytest.approx(0.75)
    assert start.after(0, 0) == start
    worse = start.after(4, 0)
    better = start.after(4, 4)
    assert worse.rate < start.rate < better.rate


def test_rows_that_cost_nothing_make_the_fixed_part_all():
    cost = PassCost(prior_fixed_rows=0.0)
    for rows in (1, 4, 8, 16):
        cost.observe(rows, 0.020, sessions=1)
    assert Advisor(cost).advise(Acceptance(), max_draft=16, last_draft=16) >= 8  # near the most
    assert cost.fixed_rows == MAX_FIXED_ROWS


def test_sharing_follows_the_sessions_in_recent_passes():
    cost = PassCost(prior_fixed_rows=40.0)
    alone = Advisor(cost).advise(Acceptance(9.0, 1.0), max_draft=16, last_draft=16)
    for _ in range(300):
        cost.observe(64, 0.05, sessions=16)
    assert cost.sharing > 10
    assert Advisor(cost).advise(Acceptance(9.0, 1.0), max_draft=16, last_draft=16) < alone


def test_sessions_sharing_passes_are_advised_alike_from_every_sessions_acceptance():
    """Loaded, a pass is as wide as its widest round: a session is advised mostly from
    the acceptance of every round of its owner's sessions, so its rounds match theirs."""
    cost = PassCost(prior_fixed_rows=None, seed=CPU_PROBE)
    advisor = Advisor(cost)
    lucky, unlucky = Acceptance(9.5, 0.5), Acceptance(5.0, 5.0)
    assert advisor.advise(lucky, 16, 16) != advisor.advise(unlucky, 16, 16)  # alone: its own
    for _ in range(300):
        cost.observe(24, 0.105, sessions=8)
        advisor.count("", 2, 2)
        advisor.count("", 2, 1)
    assert advisor.advise(lucky, 16, 16) == advisor.advise(unlucky, 16, 16) > 0


@pytest.mark.parametrize("sessions", [1, 8])
def test_one_keys_rejected_drafts_never_move_the_advice_another_key_gets(sessions):
    """The pool is per owner: mallory's drafts, rejected however often (or marked sure by
    her client), leave alice's advice as her own rounds and the passes' cost make it."""
    advice = []
    for mallory_rounds in (0, 300):
        cost = PassCost(prior_fixed_rows=None, seed=CPU_PROBE)
        advisor = Advisor(cost)
        for i in range(300):
            cost.observe(24, 0.105, sessions=sessions)
            advisor.count("alice", 2, 2 if i % 4 else 1)
            if i < mallory_rounds:
                advisor.count("mallory", 2, 0)
        advice.append(advisor.advise(Acceptance(9.0, 1.0), 16, 16, owner="alice"))
    assert advice[0] == advice[1]
    assert advisor.pool("alice") != advisor.pool("mallory")


def test_shared_advice_prefers_the_shorter_length_near_a_tie_and_holds_it():
    """Near a tie the shortest length is advised, and held until a longer one clearly
    beats it (flickering would pad every session's round of the pass); a longer length
    held is left as soon as a shorter one is near."""
    seconds = line_seconds(4.0)  # k = 1: 1.75 tokens in 12 rows' time; k = 2: 2.31 in 16
    assert advised_draft(0.75, seconds, sharing=4, max_draft=8) == 1
    assert advised_draft(0.75, seconds, sharing=4, max_draft=8, keep=2) == 1  # 1% worse
    assert advised_draft(0.75, seconds, sharing=4, max_draft=8, keep=6) == 1  # far worse
    # a = 0.85: k = 2 is 4% better than k = 1 (2.57 tokens in 16 rows' time against
    # 1.85 in 12), so it is advised, but a session holding k = 1 keeps it.
    assert advised_draft(0.85, seconds, sharing=4, max_draft=8) == 2
    assert advised_draft(0.85, seconds, sharing=4, max_draft=8, keep=1) == 1
    assert advised_draft(0.85, seconds, sharing=4, max_draft=8, keep=0) == 2  # far worse


def test_the_advice_grows_at_most_to_twice_the_last_draft_and_one():
    """While load rises, a long draft advised for few sessions would land in a full
    pass: the advice climbs from the session's last draft instead."""
    advisor = Advisor(PassCost(prior_fixed_rows=200.0))  # rows cost next to nothing
    good = Acceptance(9.5, 0.5)
    assert [advisor.advise(good, 16, last) for last in (0, 1, 3, 7, 16)] == [1, 3, 7, 15, 16]


def test_below_the_smallest_pass_seen_the_time_is_in_proportion_to_the_rows():
    cost = PassCost(prior_fixed_rows=None)
    for _ in range(5):
        cost.observe(4, 0.040, sessions=2)
        cost.observe(8, 0.060, sessions=2)
    t = cost.seconds()
    assert t(1) == pytest.approx(0.010) and t(2) == pytest.approx(0.020)


def test_near_a_tie_between_no_draft_and_a_draft_alone_chunks_and_shared_drafts():
    """Alone, a tie goes to no draft (never slower than the verifier alone); sessions
    sharing passes draft, unless no draft is what they hold or it is clearly best."""
    seconds = line_seconds(0.0)  # rows cost exactly their number
    tie = 0.96  # E(1) / 2 = 0.98: a draft 2% below no draft
    assert advised_draft(tie, seconds, sharing=1.0, max_draft=4) == 0
    assert advised_draft(tie, seconds, sharing=8.0, max_draft=4) == 1
    assert advised_draft(tie, seconds, sharing=8.0, max_draft=4, keep=0) == 0
    assert advised_draft(0.5, seconds, sharing=8.0, max_draft=4, keep=1) == 0  # 0.75: far
