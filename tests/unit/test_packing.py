"""Packing, on the fake runtime: new sessions take the lowest KV sequence ids no session
holds, so that their rounds share one forward pass; cached prefixes move out of the way
and reused ones move down, by copies, and every answer stays the cold one."""

from __future__ import annotations

import random

import pytest

from server.verifier.decoding.engine import Engine
from server.verifier.decoding.passes import plan_passes
from tests.fixtures.fake_runtime import FakeRuntime
from tests.fixtures.invariants import check_table
from tests.fixtures.stepped import make_engine
from tests.unit.test_engine_races import assert_consistent
from tests.unit.test_prefix_cache import MIN_REUSE, decode, open_session, random_step


def build(max_sessions: int, pack_sessions: bool = True) -> tuple[FakeRuntime, Engine]:
    runtime = FakeRuntime(n_seq_max=max_sessions)
    engine = make_engine(
        runtime, max_draft=8, prefix_cache_min_tokens=MIN_REUSE, pack_sessions=pack_sessions
    )
    return runtime, engine


def live_seq_ids(engine: Engine) -> list[int]:
    return sorted(s.seq_id for s in engine.sessions.sessions())


def runs(seq_ids: set[int]) -> int:
    """Runs of neighbouring ids: the passes one round of each of these sessions takes."""
    return sum(s - 1 not in seq_ids for s in seq_ids)


def sessions_leaving_a_prefix_between_live_ones(runtime: FakeRuntime, engine: Engine):
    """Sessions at 0, 1, 2; the one at 1 ends, its prefix cached there."""
    prompts = [list(range(2, 12)), list(range(20, 32)), list(range(40, 50))]
    opened = [open_session(engine, prompt)[0] for prompt in prompts]
    engine.sessions.delete(opened[1].session_id)
    assert engine.sessions.cached_prefixes.keys() == {1}
    return opened, prompts


def test_a_new_session_fills_the_gap_and_the_prefix_there_moves_away():
    runtime, engine = build(max_sessions=5)
    opened, prompts = sessions_leaving_a_prefix_between_live_ones(runtime, engine)
    cached_tokens = engine.sessions.cached_prefixes[1].tokens
    newcomer, _ = open_session(engine, list(range(55, 63)), owner="b")
    assert engine.session(newcomer.session_id).seq_id == 1
    assert engine.sessions.cached_prefixes.keys() == {4}  # the free id beside no session
    assert runtime.cells[4] == cached_tokens and runtime.copies == [(1, 4)]
    # The prefix serves its key's next prompt from its new place, moved down again beside
    # the sessions, and answers as a cold decode would.
    again = [*prompts[1][:10], 60, 61]
    reused, _ = open_session(engine, again)
    assert reused.cached_tokens == 10
    assert engine.session(reused.session_id).seq_id == 3
    assert live_seq_ids(engine) == [0, 1, 2, 3]
    assert decode(engine, reused.session_id, 8) == runtime.reference_greedy(again, 8)
    assert decode(engine, newcomer.session_id, 8, "b") == runtime.reference_greedy(range(55, 63), 8)
    for response, prompt in zip([opened[0], opened[2]], [prompts[0], prompts[2]], strict=True):
        assert decode(engine, response.session_id, 6) == runtime.reference_greedy(prompt, 6)
    assert len(runtime.copies) == 2
    assert_consistent(runtime, engine)
    # Side by side, the four sessions' rounds make one pass.
    assert len(plan_passes({s: 5 for s in live_seq_ids(engine)}, 64, 10.0)) == 1


def test_without_packing_nothing_moves():
    runtime, engine = build(max_sessions=5, pack_sessions=False)
    _, prompts = sessions_leaving_a_prefix_between_live_ones(runtime, engine)
    newcomer, _ = open_session(engine, list(range(55, 63)), owner="b")
    assert engine.session(newcomer.session_id).seq_id == 3
    reused, _ = open_session(engine, [*prompts[1][:10], 60, 61])
    assert reused.cached_tokens == 10 and engine.session(reused.session_id).seq_id == 1
    assert runtime.copies == []
    assert_consistent(runtime, engine)


def test_with_no_free_id_nothing_moves_and_the_prefix_is_reused_in_place():
    runtime, engine = build(max_sessions=3)
    _, prompts = sessions_leaving_a_prefix_between_live_ones(runtime, engine)
    reused, _ = open_session(engine, [*prompts[1][:10], 60, 61])
    assert engine.session(reused.session_id).seq_id == 1 and runtime.copies == []
    assert_consistent(runtime, engine)


def test_a_move_that_joins_no_runs_is_not_made():
    """A full table: the prefix dropped to make room leaves an id beside the session, as
    good as the other prefix's, so that one stays where it is."""
    runtime, engine = build(max_sessions=3)
    prompts = [list(range(2, 12)), list(range(20, 32)), list(range(40, 50))]
    opened = [open_session(engine, prompt)[0] for prompt in prompts]
    engine.sessions.delete(opened[2].session_id)  # cached first: dropped first
    engine.sessions.delete(opened[0].session_id)
    newcomer, _ = open_session(engine, list(range(55, 63)), owner="b")
    assert engine.session(newcomer.session_id).seq_id == 2
    assert engine.sessions.cached_prefixes.keys() == {0} and runtime.copies == []
    assert_consistent(runtime, engine)


def test_a_failed_move_leaves_every_id_accounted_for():
    runtime, engine = build(max_sessions=5)
    _, prompts = sessions_leaving_a_prefix_between_live_ones(runtime, engine)
    open_session(engine, list(range(55, 63)), owner="b")  # the prefix moves up to 4
    # Emptying the id the reused prefix then moves away from fails.
    runtime.fail_remove = lambda seq_id, p0: (seq_id, p0) == (4, -1)
    reused, _ = open_session(engine, [*prompts[1][:10], 60, 61])
    runtime.fail_remove = None
    assert engine.session(reused.session_id).seq_id == 3
    assert decode(engine, reused.session_id, 8) == runtime.reference_greedy(
        [*prompts[1][:10], 60, 61], 8
    )
    check_table(engine.sessions)
    assert 4 not in engine.sessions.cached_prefixes and runtime.cells[4]  # free, not empty
    # Whoever takes it next empties it first.
    opened, _ = open_session(engine, list(range(30, 40)), owner="c")
    assert engine.session(opened.session_id).seq_id == 4
    assert decode(engine, opened.session_id, 6, "c") == runtime.reference_greedy(range(30, 40), 6)
    assert_consistent(runtime, engine)


@pytest.mark.parametrize("seed", range(6))
def test_sessions_coming_and_going_stay_packed_and_exact(seed):
    """Random sessions over a few shared prefixes, two keys, six sequences: whenever an
    id is free, a new session goes where it adds the fewest runs of neighbouring ids
    (passes), every answer is the cold one and every sequence holds what the table says."""
    rng = random.Random(seed)
    runtime, engine = build(max_sessions=6)
    live: list[tuple[str, str, list[int]]] = []
    for _ in range(80):
        step = random_step(engine, rng, live, end_share=0.45)
        if step is None:
            continue
        owner, prompt = step
        held_before = set(live_seq_ids(engine))
        free_before = len(engine.sessions.cached_prefixes) + len(held_before) < 6
        response, _ = open_session(engine, prompt, owner)
        seq_id = engine.session(response.session_id).seq_id
        if free_before:  # it went where it adds the fewest runs of neighbouring ids
            fewest = min(runs(held_before | {s}) for s in set(range(6)) - held_before)
            assert runs(held_before | {seq_id}) == fewest
        n = rng.randint(1, 6)
        assert decode(engine, response.session_id, n, owner) == runtime.reference_greedy(prompt, n)
        live.append((response.session_id, owner, prompt))
        assert_consistent(runtime, engine)
    assert runtime.copies  # the scenario did move sequences
