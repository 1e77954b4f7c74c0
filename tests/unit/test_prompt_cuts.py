"""Tiled prompts (server/verifier/kv/prompt_cuts.py): the cut rules against brute force, and
on the fake runtime with kernels that change from TILE rows of a sequence on, a prompt
that answers the same cold, reused, evaluated again while idle, and reopened; a chat's
next turn, sent at once, keeping its earlier answers."""

from __future__ import annotations

import itertools
import random

from server.shared.protocol import PrefillRequest, VerifyRequest
from server.verifier.decoding.engine import Engine, engine_info
from server.verifier.kv.prompt_cuts import (
    PromptCuts,
    Replies,
    next_piece,
    pads,
    prompt_tiling,
    retile_plan,
    reusable,
    span_at,
    stretches,
    tiled_end,
)
from tests.fixtures.fake_runtime import EOS, FakeRuntime, switches_by_rows
from tests.fixtures.stepped import make_engine, stepped_scheduler
from tests.unit.test_engine_races import assert_consistent

TILE = 8
MAX_DRAFT = 4  # rounds of 5 rows: below the tile
OPENER = [60, 61]  # the fake chat template's reply opener
REPLIES = Replies(tuple(OPENER), frozenset({EOS}))


def test_a_stretch_is_tiled_whole_where_it_fills_a_tile_and_not_at_all_below_one():
    assert [tiled_end(n + 1, 8) for n in (0, 7, 8, 15, 16, 17, 23, 24, 31)] == [
        0, 0, 8, 15, 16, 17, 23, 24, 31,
    ]  # fmt: skip
    assert tiled_end(1000, 0) == 0
    # One stretch without an opener: the prompt's tiled part as a whole (its last token,
    # the first round's row, below the tile).
    assert prompt_tiling(list(range(2, 40)), 38, 8) == ((0, 37),)
    assert prompt_tiling(list(range(2, 40)), 38, 0) == ()


def test_a_shorter_stretch_is_padded_to_a_tile_where_that_costs_less_the_later_it_starts():
    # Below the tile a row's attention runs over the whole context: the later a stretch
    # starts, the fewer rows it takes for a padded tiled pass to cost less.
    fewest = [min((r for r in range(1, 64) if pads(s, r, 64, "auto")), default=None)
              for s in (0, 100, 500, 1000, 2000, 8000)]  # fmt: skip
    assert fewest[0] is None  # at the start, a tile costs more than 63 rows below it
    assert all(a > b for a, b in itertools.pairwise(fewest[1:]))
    # Never fewer than a few rows, however long the context: a tile's work grows with it too.
    assert fewest[-1] > 4 and fewest[3] <= 16 <= fewest[2] <= 24 <= fewest[1] < 64
    assert all(pads(0, r, 64, "always") and not pads(5000, r, 64, "off") for r in range(1, 64))
    # A stretch's tiled part: whole where padded, as where it fills a tile.
    assert [tiled_end(n + 1, 64, 1000, "auto") for n in (0, 5, 20, 70)] == [0, 0, 20, 70]
    assert [tiled_end(n + 1, 64, 1000, "always") for n in (0, 1, 5)] == [0, 1, 5]
    assert tiled_end(21, 64, 1000, "off") == 0 and tiled_end(21, 0, 1000, "always") == 0
    # The next prompt holds the stretch as cut: the rule reads only where it starts and
    # how long it is.
    words = [2 + i % 50 for i in range(1000)]
    later = [*words[:990], *OPENER, 5, 6, EOS, *words[:20], *OPENER]  # last: [994, 1017)
    tiling = prompt_tiling(later, len(later), 64, REPLIES, "auto")
    assert tiling == ((0, 991), (994, 1016))
    assert prompt_tiling(later, len(later), 64, REPLIES, "off") == ((0, 991),)
    cuts = PromptCuts(512, 64, REPLIES, "auto")
    assert cuts.piece(994, tiling, 1016) == 22 and cuts.pass_rows(994, tiling) == 64
    assert cuts.pass_rows(991, tiling) == 0  # the reply opener's, below the tile


def chat(rng: random.Random, turns: int, tile: int) -> list[int]:
    """A random chat prompt: user words, then the opener, a reply, an end; ending with
    the opener (the generation prompt)."""
    tokens: list[int] = []
    for _ in range(turns):
        tokens += [2 + rng.randrange(50) for _ in range(rng.randint(0, 5 * tile))] + OPENER
        tokens += [2 + rng.randrange(58) for _ in range(rng.randint(0, 4 * tile))] + [EOS]
    return tokens + [2 + rng.randrange(50) for _ in range(rng.randint(1, 3 * tile))] + OPENER


def brute_force_stretches(tokens: list[int]) -> list[tuple[int, int]]:
    """Position by position: in a reply from just after an opener to just before an end."""
    in_reply, found, start = False, [], 0
    for p, token in enumerate(tokens):
        if in_reply and token == EOS:
            in_reply, start = False, p
        opens = tokens[p + 1 - len(OPENER) : p + 1] == OPENER
        if not in_reply and opens and p + 1 - len(OPENER) >= start:
            found.append((start, p + 1))
            in_reply, start = True, p + 1
    if not in_reply and start < len(tokens):
        found.append((start, len(tokens)))
    return found


def test_stretches_end_with_the_opener_and_start_again_at_the_replys_end():
    rng = random.Random(5)
    for _ in range(500):
        tokens = chat(rng, rng.randint(0, 4), 4)[: rng.randint(1, 200)]
        assert stretches(tokens, len(tokens), REPLIES) == brute_force_stretches(tokens)
    tokens = [5, 6, *OPENER, 7, 8, EOS, 9, *OPENER]
    assert stretches(tokens, len(tokens), REPLIES) == [(0, 4), (6, 10)]
    assert stretches(tokens, len(tokens), Replies()) == [(0, 10)]
    # A stretch is cut the same way in every prompt that holds it whole.
    for _ in range(300):
        first = chat(rng, rng.randint(0, 3), 4)
        reply = [2 + rng.randrange(58) for _ in range(rng.randint(0, 40))]
        second = [*first, *reply, EOS, *chat(rng, rng.randint(0, 2), 4)]
        then = prompt_tiling(second, len(second), 4, REPLIES)
        assert prompt_tiling(first, len(first), 4, REPLIES) == tuple(
            span for span in then if span[1] <= len(first)
        )
        assert all(span_at(then, p) is None for p in range(len(first), len(first) + len(reply)))


def test_pieces_fill_each_tiled_span_in_passes_of_a_tile_or_more_the_rest_below():
    rng = random.Random(7)
    for _ in range(2000):
        tile = rng.choice((4, 8, 64))
        size = rng.randint(2 * tile, 8 * tile)
        tokens = chat(rng, rng.randint(0, 3), tile)
        replies, pad = rng.choice((REPLIES, Replies())), rng.choice(("auto", "always", "off"))
        tiling = prompt_tiling(tokens, len(tokens), tile, replies, pad)
        total = len(tokens) - 1
        done = rng.choice([0, *(rng.randint(s, max(s, e - tile)) for s, e in tiling)])
        pieces = []
        while done < total:
            n = next_piece(done, tiling, total, size, tile - 1, tile)
            pieces.append((done, n))
            done += n
        for start, n in pieces:
            assert n > 0
            span = span_at(tiling, start)
            if span is not None:  # a tiled pass: never below a tile, never across its end
                # (a span shorter than a tile: whole, its pass padded)
                short = span[1] - span[0] < tile
                assert n == span[1] - span[0] if short else tile <= n <= size
                assert start + n <= span[1]
            else:  # below the tile, never into a span
                assert n < tile and all(span_at(tiling, p) is None for p in range(start, start + n))


def brute_force_kept(common: int, cached: tuple, prompt: tuple, tile: int) -> int:
    """The most cells a prompt may keep: each kept cell written as the prompt's own cold
    evaluation writes it, and what is left of a tiled span enough for a tiled pass."""

    def fits(k: int) -> bool:
        same = all((span_at(cached, p) is None) == (span_at(prompt, p) is None) for p in range(k))
        span = span_at(prompt, k)
        return same and (span is None or span[0] == k or span[1] - k >= tile)

    return max(k for k in range(common + 1) if fits(k) or k == 0)


def test_what_a_prompt_keeps_of_a_cached_prefix_is_the_most_brute_force_allows():
    rng = random.Random(11)
    for _ in range(3000):
        tile = rng.choice((2, 4, 8))
        replies, pad = rng.choice((REPLIES, Replies())), rng.choice(("auto", "always", "off"))
        tokens = chat(rng, rng.randint(0, 3), tile)
        cells = rng.randint(0, len(tokens))
        cached = rng.choice(
            (
                (),
                ((0, cells),) if cells >= tile else (),
                prompt_tiling(tokens, cells, tile, replies, rng.choice(("always", pad))),
            )
        )
        prompt = prompt_tiling(tokens, len(tokens), tile, replies, pad)
        common = rng.randint(0, cells)
        want = brute_force_kept(common, cached, prompt, tile)
        assert reusable(common, cached, prompt, tile) == want
    assert reusable(30, (), ((0, 64),), 0) == 30  # nothing tiled: everything shared is kept


def test_a_cached_prefix_is_evaluated_again_whole_where_a_tile_of_cells_or_more_differ():
    text = list(range(2, 60)) * 4
    assert retile_plan(text[:38], ((0, 24),), 8) == (24, ((0, 38),))
    assert retile_plan(text[:38], ((0, 38),), 8) is None  # done already
    assert retile_plan(text[:130], (), 64) == (0, ((0, 130),))
    assert retile_plan(text[:200], ((0, 130),), 64) == (130, ((0, 200),))
    # Fewer than a tile differ: a tiled pass would be spent on them; left as they are.
    assert retile_plan(text[:200], ((0, 160),), 64) is None
    assert retile_plan(text[:63], (), 64) is None  # a prompt going on from it may not tile it
    assert retile_plan(text[:200], ((0, 190),), 0) is None
    # A chat's answer is a reply: below the tile already, nothing to do.
    first = [*text[:29], *OPENER]
    assert retile_plan([*first, *text[:20]], ((0, 24),), 8, REPLIES) is None
    # Its stretches before the last are cut as in any prompt; the last goes on past a tile.
    later = [*first, *text[:5], EOS, *text[:31]]  # its last stretch: [36, 68)
    tiling = prompt_tiling(later, len(later), 8, REPLIES)
    assert tiling == ((0, 30), (36, 67))
    assert retile_plan(later, tiling, 8, REPLIES) is None  # one cell differs: left
    generated = [*later, *text[:10]]  # its last stretch goes on with generated tokens
    assert retile_plan(generated, tiling, 8, REPLIES) == (67, ((0, 30), (36, 78)))
    assert retile_plan([*later[:-2], *OPENER], tiling, 8, REPLIES) is None  # closed: as cut


def build(opener: list[int] = (), **settings) -> tuple[FakeRuntime, Engine]:
    runtime = FakeRuntime(
        kernel=switches_by_rows(TILE, 999), n_batch=64, n_ctx_per_seq=256, n_seq_max=4
    )
    runtime.opener = list(opener)
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


def test_the_probe_finds_tiled_prompts_exact_and_a_cold_prompt_goes_tiled_whole():
    runtime, engine = build()
    info = engine_info(engine)
    assert info.prompt_tile_rows == TILE and info.prompt_chunk == 64 and info.prompt_pad == "auto"
    assert info.prefill_chunk_invariant and info.prefix_cache and info.batch_invariant
    prompt = [2 + i % 50 for i in range(30)]  # 29 evaluated: all tiled, in one pass
    before = len(runtime.decodes)
    session = open_session(engine, prompt)
    assert [len(d) for d in runtime.decodes[before:]] == [29]
    assert decode(engine, session.session_id, 9) == runtime.reference_greedy(prompt, 9, 29)
    assert_consistent(runtime, engine)


def answered(engine: Engine, prompt: list[int], n: int) -> list[int]:
    """A session's answer of `n` tokens, the session ended (its cells cached)."""
    session_id = open_session(engine, prompt).session_id
    answer = decode(engine, session_id, n)
    engine.sessions.delete(session_id)
    return answer


def test_a_next_turn_keeps_the_tiled_part_then_all_but_a_tile_once_evaluated_again_idle():
    runtime, engine = build()
    first = [2 + i % 50 for i in range(30)]
    answer = answered(engine, first, 30)  # 59 cells cached, 29 tiled
    second = [*first, *answer, 50]  # 60 evaluated, all tiled
    crossing = [*first, *answer, 50, 51, 52]  # 62 evaluated, all tiled

    reused = open_session(engine, second)
    assert reused.cached_tokens == 29  # the answer was written by rounds: not the prompt's
    assert decode(engine, reused.session_id, 6) == runtime.reference_greedy(second, 6, 60)
    engine.sessions.delete(reused.session_id)  # cached again: 66 cells, 60 tiled

    # Evaluated again idle, every cell is a tiled one; a prompt going on keeps them up to
    # where what it has left fills a tiled pass.
    for prompt, kept, tiled in ((second, 60 - TILE, 60), (crossing, 62 - TILE, 62)):
        runtime, engine = build()
        assert answered(engine, first, 30) == answer
        # A piece at a time, two tiles at most, never leaving less than a tile.
        assert [engine.retile() for _ in range(3)] == [16, 59 - 29 - 16, 0]
        (cached,) = engine.sessions.cached_prefixes.values()
        assert cached.tiling == ((0, 59),) and len(cached.tokens) == 59
        assert_consistent(runtime, engine)
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
    answered(engine, [2 + i % 50 for i in range(30)], 30)
    assert [scheduler.run_idle_work() for _ in range(3)] == [16, 59 - 29 - 16, 0]
    assert_consistent(runtime, engine)


def test_while_rounds_wait_a_prompts_tiled_part_goes_two_tiles_a_pass_and_answers_alike():
    """A prompt with the verifier to itself takes passes as long as n_batch; while a
    session's rounds wait, two tiles a pass (the rounds come back sooner). The cuts
    change nothing: the prompt answers as cold either way."""
    from server.verifier.scheduling.cycle import CycleStep, Job
    from tests.unit.test_cycle import round_job

    runtime = FakeRuntime(
        kernel=switches_by_rows(TILE, 999), n_batch=64, n_ctx_per_seq=256, n_seq_max=4
    )
    cycle = CycleStep(make_engine(runtime, max_draft=MAX_DRAFT, prompt_tile_rows=TILE))
    prompt = [2 + i % 50 for i in range(58)]  # 57 evaluated: all tiled
    alone = Job("b", None, request=PrefillRequest(prompt_tokens=prompt, add_bos=False))
    before = len(runtime.decodes)
    while not any(job is alone for job, _ in cycle.step([alone]).answers):
        pass
    assert [len(d) for d in runtime.decodes[before:]] == [57]

    busy = Job("a", None, request=PrefillRequest(prompt_tokens=[3, 4, 5], add_bos=False))
    ((_, opened),) = cycle.step([busy]).answers
    shared = Job("b", None, request=PrefillRequest(prompt_tokens=prompt, add_bos=False))
    sizes = []
    while True:
        answered = dict(cycle.step([round_job(opened, []), shared]).answers)
        sizes += [len(d) for d in runtime.decodes[-1:] if d[0].seq_id != opened.session.seq_id]
        if shared in answered:
            break
    assert sizes == [2 * TILE, 2 * TILE, 2 * TILE, 57 - 6 * TILE]  # the last never below a tile
    reference = runtime.reference_greedy(prompt, 5, 57)
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
    answer = answered(engine, first, 30)  # 59 cells, 29 tiled: again from 29, to 59
    assert engine.retile() == 2 * TILE
    (cached,) = engine.sessions.cached_prefixes.values()
    assert len(cached.tokens) == 45 and cached.tiling == ((0, 45),)
    assert_consistent(runtime, engine)
    second = [*first, *answer, 50]  # all 60 evaluated tiled: keeps the 45 cells there are
    reused = open_session(engine, second)
    assert reused.cached_tokens == 45
    assert decode(engine, reused.session_id, 6) == runtime.reference_greedy(second, 6, 60)
    assert engine.retile() == 0  # the prefix was taken: nothing left to do
    assert_consistent(runtime, engine)


def test_a_chats_next_turn_sent_at_once_keeps_its_answer_and_answers_as_cold():
    """The answer's cells were written by rounds, below the tile; the next turn holds it
    as a reply, below the tile too: every cell is kept, with no idle work between. With
    replies read as any text (the setting off), only the first prompt's tiled part is."""
    words = [2 + i % 50 for i in range(28)]
    for below, kept, tiling in ((True, 38, ((0, 29), (39, 61))), (False, 29, ((0, 61),))):
        runtime, engine = build(OPENER, prompt_replies_below_tile=below)
        first = [*words, *OPENER]  # 30 tokens, 29 evaluated: all tiled
        answer = answered(engine, first, 9)  # 38 cells cached
        assert EOS not in answer
        second = [*first, *answer, EOS, *words[:20], *OPENER]  # a reply at [30, 39)
        assert engine.cuts.tiling(second, len(second)) == tiling
        reused = open_session(engine, second)
        assert reused.cached_tokens == kept
        # A tile's worth of answer or more: read as text, it differs from what a prompt
        # going on would tile in that many cells.
        got = decode(engine, reused.session_id, 2 * TILE)
        assert got == runtime.reference_greedy(second, 2 * TILE, tiling)
        assert_consistent(runtime, engine)
        engine.sessions.delete(reused.session_id)
        # Below the tile, a reply needs no idle work; read as text, it gets it.
        assert (engine.retile() == 0) == below


def test_chats_of_every_length_sent_at_once_keep_every_earlier_cell_and_answer_as_cold():
    runtime, engine = build(OPENER)
    rng = random.Random(4)
    histories: dict[str, list[int]] = {"a": [], "b": []}
    padded = 0
    for _ in range(30):
        owner = rng.choice("ab")
        history = histories[owner] if len(histories[owner]) < 150 else []
        length = rng.choice((rng.randint(1, 6), rng.randint(1, 30)))  # some short of a tile
        words = [2 + rng.randrange(50) for _ in range(length)]
        prompt = [*history, *([EOS] if history and history[-1] != EOS else []), *words, *OPENER]
        response = open_session(engine, prompt, owner)
        assert response.cached_tokens == max(0, len(history) - 1)  # every cell there is
        n = rng.randint(1, 12)
        answer = decode(engine, response.session_id, n, owner)
        tiling = prompt_tiling(prompt, len(prompt), TILE, REPLIES, "auto")
        padded += sum(e - s < TILE for s, e in tiling)
        assert answer == runtime.reference_greedy(prompt, n, tiling)
        engine.sessions.delete(response.session_id)
        histories[owner] = [*prompt, *answer]
        assert_consistent(runtime, engine)
    assert padded > 0  # short stretches late in a chat went padded to a tile


def test_a_reopened_chat_session_goes_on_exactly():
    runtime, engine = build(OPENER)
    prompt = [*[2 + i % 50 for i in range(20)], *OPENER, 5, 6, 7, EOS, *range(2, 30), *OPENER]
    whole = decode(engine, open_session(engine, prompt).session_id, 14)
    reopened = open_session(engine, [*prompt, *whole[:6]], generated=6)
    assert decode(engine, reopened.session_id, 8) == whole[6:14]
    assert_consistent(runtime, engine)


def test_a_short_next_message_late_in_a_chat_goes_in_one_pass_padded_to_a_tile():
    """Its stretch (the end of turn, three words, the opener: five rows to evaluate) is
    short of a tile; that late in the chat a tiled pass padded to a tile costs less than
    its rows below it. One pass of TILE rows, the padding's cells gone after it; the
    answer as the reference's with that stretch tiled; with padding off, below the tile
    (with the answer's last token, which the session left unevaluated)."""
    words = [2 + i % 50 for i in range(150)]
    for pad, passes in (("auto", [1, TILE]), ("off", [1 + 5])):
        runtime, engine = build(OPENER, prompt_pad=pad)
        assert engine_info(engine).prompt_pad == pad
        first = [*words, *OPENER]
        answer = answered(engine, first, 6)
        assert EOS not in answer
        second = [*first, *answer, EOS, 7, 8, 9, *OPENER]
        tiling = engine.cuts.tiling(second, len(second))
        short = (len(first) + len(answer), len(second) - 1)
        assert tiling == ((0, len(first) - 1), short) if pad == "auto" else ((0, len(first) - 1),)
        before = len(runtime.decodes)
        reused = open_session(engine, second)
        assert reused.cached_tokens == len(first) + len(answer) - 1
        assert [len(d) for d in runtime.decodes[before:]] == passes
        assert_consistent(runtime, engine)  # no padding cell left behind
        got = decode(engine, reused.session_id, 8)
        assert got == runtime.reference_greedy(second, 8, tiling)
        assert_consistent(runtime, engine)
