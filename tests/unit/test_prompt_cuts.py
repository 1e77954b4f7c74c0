"""Tiled prompts (server/verifier/prompt_cuts.py): the cut rules against brute force, and
on the fake runtime with kernels that change from TILE rows of a sequence on, a prompt
that answers the same cold, reused, evaluated again while idle, and reopened."""

from __future__ import annotations

import random

from server.shared.protocol import PrefillRequest, VerifyRequest
from server.verifier.engine import Engine, engine_info
from server.verifier.prompt_cuts import next_piece, retile_plan, reusable, tiled_end
from tests.fixtures.fake_runtime import FakeRuntime, switches_by_rows
from tests.fixtures.stepped import make_engine, stepped_scheduler
from tests.unit.test_engine_races import assert_consistent

TILE = 8
MAX_DRAFT = 4  # rounds of 5 rows: below the tile


def test_a_prompts_tiled_part_ends_at_its_last_tile_whole_below_two_none_below_one():
    assert [tiled_end(n + 1, 8) for n in (0, 7, 8, 15, 16, 17, 23, 24, 31)] == [
        0, 0, 8, 15, 16, 16, 16, 24, 24,
    ]  # fmt: skip
    assert tiled_end(1000, 0) == 0


def test_pieces_fill_the_tiled_part_in_passes_of_a_tile_or_more_then_the_rest_below():
    rng = random.Random(7)
    for _ in range(2000):
        tile = rng.choice((4, 8, 64))
        size = rng.randint(2 * tile, 8 * tile)
        total = rng.randint(0, 20 * tile)
        tiled_to = tiled_end(total + 1, tile)
        done = rng.randint(0, tiled_to - tile) if tiled_to >= tile else tiled_to
        pieces = []
        while done < total:
            n = next_piece(done, tiled_to, total, size, tile - 1, tile)
            pieces.append((done, n))
            done += n
        for start, n in pieces:
            assert n > 0
            if start < tiled_to:  # a tiled pass: never below a tile, never across its end
                assert tile <= n <= size and start + n <= tiled_to
            else:
                assert n < tile


def brute_force_kept(common: int, cached_tiled: int, prompt_tiled: int, tile: int) -> int:
    """The most cells a prompt may keep: each kept cell written as the prompt's own cold
    evaluation writes it (tiled below its tiled end, not after), and what is left of its
    tiled part enough for a tiled pass."""

    def fits(k: int) -> bool:
        same = all((p < cached_tiled) == (p < prompt_tiled) for p in range(k))
        return same and (k >= prompt_tiled or prompt_tiled - k >= tile)

    return max(k for k in range(common + 1) if fits(k) or k == 0)


def test_what_a_prompt_keeps_of_a_cached_prefix_is_the_most_brute_force_allows():
    rng = random.Random(11)
    for _ in range(3000):
        tile = rng.choice((2, 4, 8))
        cells = rng.randint(0, 12 * tile)
        cached_tiled = rng.choice((0, tiled_end(rng.randint(1, cells + 1), tile), cells))
        prompt_tiled = tiled_end(rng.randint(1, 16 * tile), tile)
        common = rng.randint(0, cells)
        want = brute_force_kept(common, cached_tiled, prompt_tiled, tile)
        assert reusable(common, cached_tiled, prompt_tiled, tile) == want
    assert reusable(30, 0, 64, 0) == 30  # nothing tiled: everything shared is kept


def test_a_cached_prefix_is_evaluated_again_up_to_its_last_tile_from_a_tile_before():
    assert retile_plan(38, 24, 8) == (24, 32)
    assert retile_plan(38, 32, 8) is None  # done already
    assert retile_plan(130, 0, 64) == (0, 128) and retile_plan(200, 160, 64) == (128, 192)
    assert retile_plan(127, 0, 64) is None  # a longer prompt below two tiles tiles whole
    assert retile_plan(200, 190, 0) is None


def build(**settings) -> tuple[FakeRuntime, Engine]:
    runtime = FakeRuntime(
        kernel=switches_by_rows(TILE, 999), n_batch=64, n_ctx_per_seq=256, n_seq_max=4
    )
    engine = make_engine(
        runtime, max_draft=MAX_DRAFT, prefix_cache_min_tokens=4, prompt_tile_rows=TILE, **settings
    )
    return runtime, engine


def open_session(engine: Engine, prompt: list[int], owner: str = "a", generated: int = 0):
    request = PrefillRequest(prompt_tokens=prompt, add_bos=False, generated_tokens=generated)
    work = engine.begin_prefill(request, owner=owner)
    response = None
    while not work.closed:
        (response,) = engine.run([], [work]).results
        assert not isinstance(response, Exception), response
    return response.response


def decode(engine: Engine, session_id: str, n: int, owner: str = "a") -> list[int]:
    out: list[int] = []
    while len(out) < n:
        session = engine.session(session_id)
        request = VerifyRequest(session_id=session_id, n_past=len(session.tokens))
        (response,) = engine.run([engine.begin_verify(request, owner)]).results
        out += response.tokens
    return out[:n]


def test_the_probe_finds_tiled_prompts_exact_and_cold_prompts_go_in_whole_tiles():
    runtime, engine = build()
    info = engine_info(engine)
    assert info.prompt_tile_rows == TILE and info.prompt_chunk == 64
    assert info.prefill_chunk_invariant and info.prefix_cache and info.batch_invariant
    prompt = [2 + i % 50 for i in range(30)]  # 29 evaluated: 24 tiled, 5 after
    before = len(runtime.decodes)
    session = open_session(engine, prompt)
    assert [len(d) for d in runtime.decodes[before:]] == [24, 5]
    assert decode(engine, session.session_id, 9) == runtime.reference_greedy(prompt, 9, 24)
    assert_consistent(runtime, engine)


def answered(engine: Engine, prompt: list[int], n: int) -> list[int]:
    """A session's answer of `n` tokens, the session ended (its cells cached)."""
    session_id = open_session(engine, prompt).session_id
    answer = decode(engine, session_id, n)
    engine.sessions.delete(session_id)
    return answer


def test_a_next_turn_keeps_the_tiled_part_then_everything_once_evaluated_again_idle():
    runtime, engine = build()
    first = [2 + i % 50 for i in range(30)]
    answer = answered(engine, first, 9)  # 38 cells cached, 24 tiled
    second = [*first, *answer, 50]  # 39 evaluated: tiled to 32, as the cache after idle
    crossing = [*first, *answer, 50, 51, 52]  # 41 evaluated: tiled to 40

    reused = open_session(engine, second)
    assert reused.cached_tokens == 24  # the answer was written by rounds: not the prompt's
    assert decode(engine, reused.session_id, 6) == runtime.reference_greedy(second, 6, 32)
    engine.sessions.delete(reused.session_id)  # cached again: 44 cells, 32 tiled

    for prompt, kept, tiled in ((second, 38, 32), (crossing, 32, 40)):
        runtime, engine = build()
        assert answered(engine, first, 9) == answer
        # A piece at a time: the tiled part to 32, then the rest below the tile.
        assert [engine.retile() for _ in range(3)] == [32 - 24, 38 - 32, 0]
        (cached,) = engine.sessions.cached_prefixes.values()
        assert cached.tiled == 32 and len(cached.tokens) == 38
        assert_consistent(runtime, engine)
        # second: every cell (its tiled part ends where the cache's does); crossing: its
        # tiled part goes on to 40, so [32, 38) is evaluated again
        reused = open_session(engine, prompt)
        assert reused.cached_tokens == kept
        assert decode(engine, reused.session_id, 6) == runtime.reference_greedy(prompt, 6, tiled)
        assert_consistent(runtime, engine)


def test_a_reopened_session_tiles_only_its_original_prompt_and_goes_on_exactly():
    runtime, engine = build()
    prompt = [2 + i % 50 for i in range(30)]
    whole = decode(engine, open_session(engine, prompt).session_id, 14)
    reopened = open_session(engine, [*prompt, *whole[:6]], generated=6)
    assert decode(engine, reopened.session_id, 8) == whole[6:14]
    assert_consistent(runtime, engine)


def test_conversations_of_every_length_answer_as_cold_with_idle_work_between():
    runtime, engine = build()
    rng = random.Random(3)
    histories = {"a": [], "b": []}
    kept = 0
    for _ in range(24):
        owner = rng.choice("ab")
        words = [2 + rng.randrange(50) for _ in range(rng.randint(1, 20))]
        prompt = [*histories[owner], *words][-150:]
        response = open_session(engine, prompt, owner)
        kept += response.cached_tokens
        n = rng.randint(1, 12)
        answer = decode(engine, response.session_id, n, owner)
        assert answer == runtime.reference_greedy(prompt, n, tiled_end(len(prompt), TILE))
        engine.sessions.delete(response.session_id)
        histories[owner] = [*prompt, *answer]
        if rng.random() < 0.5:
            engine.retile()
        assert_consistent(runtime, engine)
    assert kept > 0


def test_the_engine_thread_runs_idle_work_through_the_scheduler():
    runtime, engine = build()
    scheduler = stepped_scheduler(engine)
    answered(engine, [2 + i % 50 for i in range(30)], 9)
    assert [scheduler.run_idle_work() for _ in range(3)] == [32 - 24, 38 - 32, 0]
    assert_consistent(runtime, engine)


def test_while_rounds_wait_a_prompts_tiled_part_goes_two_tiles_a_pass_and_answers_alike():
    """A prompt with the verifier to itself takes passes as long as n_batch; while a
    session's rounds wait, two tiles a pass (the rounds come back sooner). The cuts
    change nothing: the prompt answers as cold either way."""
    from server.verifier.cycle import CycleStep, Job
    from tests.unit.test_cycle import round_job

    runtime = FakeRuntime(
        kernel=switches_by_rows(TILE, 999), n_batch=64, n_ctx_per_seq=256, n_seq_max=4
    )
    cycle = CycleStep(make_engine(runtime, max_draft=MAX_DRAFT, prompt_tile_rows=TILE))
    prompt = [2 + i % 50 for i in range(58)]  # 57 evaluated: 56 tiled, 1 after
    alone = Job("b", None, request=PrefillRequest(prompt_tokens=prompt, add_bos=False))
    before = len(runtime.decodes)
    while not any(job is alone for job, _ in cycle.step([alone]).answers):
        pass
    assert [len(d) for d in runtime.decodes[before:]] == [56, 1]

    busy = Job("a", None, request=PrefillRequest(prompt_tokens=[3, 4, 5], add_bos=False))
    ((_, opened),) = cycle.step([busy]).answers
    shared = Job("b", None, request=PrefillRequest(prompt_tokens=prompt, add_bos=False))
    sizes = []
    while True:
        answered = dict(cycle.step([round_job(opened, []), shared]).answers)
        sizes += [len(d) for d in runtime.decodes[-1:] if d[0].seq_id != opened.session.seq_id]
        if shared in answered:
            break
    assert sizes == [2 * TILE, 2 * TILE, 2 * TILE, TILE, 1]
    reference = runtime.reference_greedy(prompt, 5, 56)
    for job in (alone, shared):
        session_id = job.session_id
        out = []
        while len(out) < 5:
            session = cycle.engine.session(session_id)
            request = VerifyRequest(session_id=session_id, n_past=len(session.tokens))
            work = cycle.engine.begin_verify(request, "b")
            (response,) = cycle.engine.run([work]).results
            out += response.tokens
        assert out[:5] == reference


def test_idle_work_goes_a_piece_at_a_time_and_a_prompt_meanwhile_keeps_what_is_done():
    """Between pieces the cached prefix holds exactly the cells evaluated again so far: a
    prompt that takes it then answers as cold, and the plan is dropped."""
    runtime, engine = build()
    first = [2 + i % 50 for i in range(30)]
    answer = answered(engine, first, 9)  # 38 cells, 24 tiled: again from 24, tiled to 32
    assert engine.retile() == 8
    (cached,) = engine.sessions.cached_prefixes.values()
    assert len(cached.tokens) == 32 and cached.tiled == 32
    assert_consistent(runtime, engine)
    second = [*first, *answer, 50]  # tiled to 32 as well: keeps the 32 cells there are
    reused = open_session(engine, second)
    assert reused.cached_tokens == 32
    assert decode(engine, reused.session_id, 6) == runtime.reference_greedy(second, 6, 32)
    assert engine.retile() == 0  # the prefix was taken: nothing left to do
    assert_consistent(runtime, engine)
