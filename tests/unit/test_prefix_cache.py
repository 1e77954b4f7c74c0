"""Prompt reuse on the verifier, on the fake runtime: an ended session's sequence serves
the same API key's next prompt, trimmed to the common prefix; nothing else changes.

The fake's logits are a function of a sequence's cells, so a wrong reuse (a cell that is
not the prompt's) changes what the session answers: every check compares with
`reference_greedy`, a cold decode of the same prompt."""

from __future__ import annotations

import random

import pytest

from server.shared.protocol import PrefillRequest, VerifyRequest
from server.verifier.decoding.engine import Engine, engine_info
from tests.fixtures.fake_runtime import FakeRuntime, switches_by_rows
from tests.fixtures.stepped import make_engine, prefilled, stepped_scheduler
from tests.unit.test_engine_races import assert_consistent

MIN_REUSE = 4


def build(max_sessions: int = 4, pin_shapes: str = "auto", **runtime) -> tuple[FakeRuntime, Engine]:
    runtime = FakeRuntime(n_seq_max=max_sessions, **runtime)
    engine = make_engine(
        runtime, max_draft=8, prefix_cache_min_tokens=MIN_REUSE, pin_shapes=pin_shapes
    )
    return runtime, engine


def open_session(
    engine: Engine, prompt_tokens: list[int], owner: str = "a", session_id: str | None = None,
    cache_scope: str | None = None,
):  # fmt: skip
    request = PrefillRequest(
        prompt_tokens=prompt_tokens, add_bos=False, session_id=session_id, cache_scope=cache_scope
    )
    work = engine.begin_prefill(request, owner=owner)
    response = None
    while not work.closed:  # a chunk at a time, as the scheduler runs them
        (response,) = engine.run([], [work]).results
        assert not isinstance(response, Exception), response
    return response.response, work


def decode(engine: Engine, session_id: str, n: int, owner: str = "a") -> list[int]:
    out = []
    while len(out) < n:
        session = engine.session(session_id)
        work = engine.begin_verify(
            VerifyRequest(session_id=session_id, n_past=len(session.tokens)), owner
        )
        (response,) = engine.run([work]).results
        out += response.tokens
    return out[:n]


def test_a_prompt_sharing_a_prefix_evaluates_only_the_rest_and_answers_as_cold():
    runtime, engine = build()
    first, _ = open_session(engine, list(range(2, 30)))
    decode(engine, first.session_id, 6)
    engine.sessions.delete(first.session_id)
    assert len(engine.sessions.cached_prefixes) == 1
    prompt = [*range(2, 22), 40, 41, 42]  # 20 tokens in common, then other ones
    before = runtime.decoded_tokens_total
    second, work = open_session(engine, prompt)
    assert second.cached_tokens == 20
    assert work.session.decoded_tokens == len(prompt) - 1 - 20
    assert runtime.decoded_tokens_total - before == len(prompt) - 1 - 20
    assert decode(engine, second.session_id, 10) == runtime.reference_greedy(prompt, 10)
    assert_consistent(runtime, engine)


def test_the_next_turn_of_a_conversation_reuses_everything_committed():
    runtime, engine = build()
    first, _ = open_session(engine, list(range(2, 40)))
    decode(engine, first.session_id, 12)
    history = list(engine.session(first.session_id).tokens)
    engine.sessions.delete(first.session_id)
    turn = [*history, 50, 51, 52]
    second, _ = open_session(engine, turn)
    assert second.cached_tokens == len(history) - 1  # all but the never-evaluated last
    assert decode(engine, second.session_id, 8) == runtime.reference_greedy(turn, 8)
    assert_consistent(runtime, engine)


def test_a_prompt_equal_to_a_cached_prefix_still_evaluates_its_last_token():
    runtime, engine = build()
    first, _ = open_session(engine, list(range(2, 20)))
    engine.sessions.delete(first.session_id)
    again, _ = open_session(engine, list(range(2, 19)))  # a prefix of what is cached
    assert again.cached_tokens == 16
    assert decode(engine, again.session_id, 5) == runtime.reference_greedy(range(2, 19), 5)
    assert_consistent(runtime, engine)


def test_another_api_key_reuses_nothing_and_short_matches_are_not_taken():
    runtime, engine = build()
    first, _ = open_session(engine, list(range(2, 30)), owner="alice")
    engine.sessions.delete(first.session_id)
    other, _ = open_session(engine, list(range(2, 30)), owner="mallory")
    assert other.cached_tokens == 0
    short, _ = open_session(engine, [2, 3, 4, 50, 51, 52], owner="alice")  # 3 < MIN_REUSE
    assert short.cached_tokens == 0
    assert len(engine.sessions.cached_prefixes) == 1  # alice's prefix is still there
    assert decode(engine, other.session_id, 5, "mallory") == runtime.reference_greedy(
        range(2, 30), 5
    )
    assert_consistent(runtime, engine)


def test_a_proxys_clients_reuse_only_their_own_scopes_prefixes_within_its_key():
    """The attack's shape on the verifier: `serve` opens every client's sessions with one
    API key; B's prompt shares a long prefix with A's recent one and gets cached_tokens 0
    from it, while A's own repeat still reuses. Without a scope (an older client), the
    key's prefixes are one cache, as ever."""
    runtime, engine = build()
    secret = list(range(2, 30))
    a, _ = open_session(engine, secret, owner="serve", cache_scope="scope-a")
    engine.sessions.delete(a.session_id)
    b, work = open_session(engine, [*secret[:-1], 60], owner="serve", cache_scope="scope-b")
    assert b.cached_tokens == 0 and work.session.cache_scope == "scope-b"
    unscoped, _ = open_session(engine, secret, owner="serve")  # nor a client with none
    assert unscoped.cached_tokens == 0
    again, _ = open_session(engine, secret, owner="serve", cache_scope="scope-a")
    assert again.cached_tokens == len(secret) - 1
    assert decode(engine, b.session_id, 5, "serve") == runtime.reference_greedy(
        [*secret[:-1], 60], 5
    )
    engine.sessions.delete(unscoped.session_id)
    old, _ = open_session(engine, secret, owner="serve")  # no scope: the key's, as ever
    assert old.cached_tokens == len(secret) - 1
    assert decode(engine, old.session_id, 5, "serve") == runtime.reference_greedy(secret, 5)
    assert_consistent(runtime, engine)


def test_a_cached_prefix_never_takes_a_live_sessions_slot():
    runtime, engine = build(max_sessions=2)
    live, _ = open_session(engine, list(range(2, 12)))
    ended, _ = open_session(engine, list(range(20, 32)))
    engine.sessions.delete(ended.session_id)
    newcomer, work = open_session(engine, list(range(40, 52)), owner="b")  # no match
    assert newcomer.cached_tokens == 0
    assert engine.sessions.cached_prefixes == {} and not work.reservation.evicted
    assert decode(engine, live.session_id, 6) == runtime.reference_greedy(range(2, 12), 6)
    assert_consistent(runtime, engine)


def test_expiry_and_the_end_of_a_generation_keep_the_prefix_eviction_does_not():
    runtime, engine = build(max_sessions=2)
    expired, _ = open_session(engine, list(range(2, 14)))
    assert engine.sessions.expire(-1.0, 600.0) == [expired.session_id]
    assert len(engine.sessions.cached_prefixes) == 1
    discarded, _ = open_session(engine, list(range(30, 42)), owner="b")
    engine.sessions.discard(discarded.session_id)
    assert len(engine.sessions.cached_prefixes) == 2
    evicted = []
    for owner in ("c", "d", "e"):  # no free sequence: prefixes go first, then sessions
        _, work = open_session(engine, [50, 51, 52, 53, 54], owner=owner)
        evicted.append(work.reservation.evicted)
    assert engine.sessions.cached_prefixes == {} and evicted == [False, False, True]
    assert_consistent(runtime, engine)


def test_reuse_is_off_where_batches_change_logits():
    runtime, engine = build(kernel=switches_by_rows(), pin_shapes="off")
    assert not engine.prefix_cache and engine_info(engine).prefix_cache is False
    first, _ = open_session(engine, list(range(2, 30)))
    engine.sessions.delete(first.session_id)
    again, _ = open_session(engine, list(range(2, 30)))
    assert again.cached_tokens == 0
    assert_consistent(runtime, engine)


STEMS = [list(range(2, 12)), [*range(2, 8), 30, 31, 32, 33], list(range(20, 34))]


def random_step(
    engine: Engine, rng: random.Random, live: list[tuple[str, str, list[int]]], end_share: float
) -> tuple[str, list[int]] | None:
    """One step of sessions coming and going over a few shared prefixes, two keys: ends
    one of `live` (None), or says who opens a session next, with what prompt."""
    if live and rng.random() < end_share:
        session_id, _, _ = live.pop(rng.randrange(len(live)))
        if session_id in {s.session_id for s in engine.sessions.sessions()}:  # not evicted
            engine.sessions.delete(session_id)
        return None
    prompt = rng.choice(STEMS)[: rng.randint(5, 14)]
    return rng.choice(["a", "b"]), prompt + [rng.randrange(2, 64) for _ in range(rng.randint(1, 4))]


@pytest.mark.parametrize("seed", range(6))
def test_reuse_under_eviction_pressure_never_reuses_wrongly(seed):
    """Random sessions over a few shared prefixes, two keys, three sequences: every answer
    is the cold one and every sequence holds what the table says, after every step."""
    rng = random.Random(seed)
    runtime, engine = build(max_sessions=3)
    live: list[tuple[str, str, list[int]]] = []
    reused = 0
    for _ in range(80):
        step = random_step(engine, rng, live, end_share=0.5)
        if step is None:
            continue
        owner, prompt = step
        response, _ = open_session(engine, prompt, owner)
        reused += response.cached_tokens
        n = rng.randint(1, 6)
        assert decode(engine, response.session_id, n, owner) == runtime.reference_greedy(prompt, n)
        live.append((response.session_id, owner, prompt))
        assert_consistent(runtime, engine)
    assert reused > 0  # the scenario did exercise reuse


def test_the_probe_turns_reuse_off_where_a_prompts_chunks_change_its_logits():
    runtime = FakeRuntime(kernel=switches_by_rows(32, 999), n_batch=128, n_ctx_per_seq=256)
    engine = make_engine(runtime, max_draft=8, prefix_cache_min_tokens=MIN_REUSE, prompt_chunk=128)
    report = engine.invariance
    assert report.batch_invariant and not report.prefill_chunk_invariant
    assert report.prefill_chunk_max_diff > 0
    info = engine_info(engine)
    assert info.prefill_chunk_invariant is False and info.prefix_cache is False
    assert not engine.prefix_cache and info.prompt_chunk == 128
    plain = make_engine(
        FakeRuntime(n_batch=128, n_ctx_per_seq=256), max_draft=8, prefix_cache_min_tokens=4
    )
    assert plain.invariance.prefill_chunk_invariant and engine_info(plain).prefix_cache
    assert plain.prompt_chunk == 128  # exact at n_batch: nothing shorter needed


def test_with_reuse_wanted_the_probe_picks_a_prompt_chunk_short_enough_to_be_exact():
    """Kernels that change from 32 rows on: prompts are cut into 16-token chunks, and a
    reused prefix (filled by a long prompt, then by rounds) answers as a cold prompt."""
    runtime = FakeRuntime(kernel=switches_by_rows(32, 999), n_batch=128, n_ctx_per_seq=256)
    engine = make_engine(runtime, max_draft=8, prefix_cache_min_tokens=MIN_REUSE)
    info = engine_info(engine)
    assert info.prompt_chunk == 16 and info.prefill_chunk_invariant and info.prefix_cache
    history = [2 + i % 60 for i in range(88)]
    first, _ = open_session(engine, history)
    answer = decode(engine, first.session_id, 9)
    engine.sessions.delete(first.session_id)
    prompt = [*history, *answer, 50, 51, 52]
    second, _ = open_session(engine, prompt)
    assert second.cached_tokens == 88 + 9 - 1  # all but the answer's pending last token
    assert decode(engine, second.session_id, 8) == runtime.reference_greedy(prompt, 8)
    runtime = FakeRuntime(kernel=switches_by_rows(32, 999), n_batch=128, n_ctx_per_seq=256)
    without_reuse = make_engine(runtime, max_draft=8)
    assert without_reuse.prompt_chunk == 128  # no reuse: nothing to gain from short chunks


def test_a_session_whose_cells_could_not_be_cleaned_is_never_cached():
    runtime, engine = build()
    session, _ = open_session(engine, list(range(2, 30)))
    seq_id = engine.session(session.session_id).seq_id
    real_remove = runtime.remove

    def refuse_trims(seq, p0, p1=-1):  # a failed round cannot be trimmed away
        if p0 != -1:
            raise RuntimeError("llama_memory_seq_rm refused")
        real_remove(seq, p0, p1)

    runtime.remove = refuse_trims
    runtime.fail_decode = lambda entries: True
    work = engine.begin_verify(VerifyRequest(session_id=session.session_id, n_past=28), "a")
    (error,) = engine.run([work]).results
    runtime.remove, runtime.fail_decode = real_remove, None
    assert isinstance(error, Exception)
    assert not list(engine.sessions.sessions())  # ended cleanly, not cached
    assert engine.sessions.cached_prefixes == {} and runtime.cells[seq_id] == []
    assert_consistent(runtime, engine)


def test_the_rest_of_a_reused_prompt_is_decoded_in_whole_chunks_each_on_its_own():
    """After a reuse of 20 tokens, the scheduler decodes the rest in chunks of
    prompt_chunk from there (reuse is on only where cuts do not change the numbers), and
    the answer is the cold prompt's."""
    import asyncio

    runtime = FakeRuntime(n_batch=16)
    engine = make_engine(runtime, max_draft=8, prefix_cache_min_tokens=MIN_REUSE)
    scheduler = stepped_scheduler(engine, max_queue=8)
    first, _ = open_session(engine, list(range(2, 23)))  # 20 cells
    engine.sessions.delete(first.session_id)
    prompt = [*range(2, 22), *range(30, 62)]  # 20 shared, 52 in all: 51 to evaluate

    async def scenario():
        task = asyncio.ensure_future(
            prefilled(scheduler, PrefillRequest(prompt_tokens=prompt, add_bos=False), "a")
        )
        decodes = len(runtime.decodes)
        while not task.done():
            await asyncio.sleep(0)
            scheduler.run_step()
        return await task, runtime.decodes[decodes:]

    response, chunks = asyncio.run(scenario())
    cuts, starts = [len(c) for c in chunks], [c[0].pos for c in chunks]
    assert response.cached_tokens == 20 and engine.prompt_chunk == 16
    assert cuts == [16, 15] and starts == [20, 36]
    assert all(len({e.seq_id for e in chunk}) == 1 for chunk in chunks)
    assert_consistent(runtime, engine)
    assert decode(engine, response.session_id, 6) == runtime.reference_greedy(prompt, 6)


def test_two_prefills_of_one_chosen_id_at_once_open_one_session_and_leak_nothing():
    """The second finds the id taken by the first while it is still being evaluated; when
    the first fails, the id is free again."""
    from server.verifier.errors import SessionExists

    runtime, engine = build()
    session_id = "chosen-by-the-client-00000001"
    request = PrefillRequest(prompt_tokens=list(range(2, 12)), add_bos=False, session_id=session_id)
    first = engine.begin_prefill(request, owner="a")
    with pytest.raises(SessionExists):
        engine.begin_prefill(request, owner="a")
    with pytest.raises(SessionExists):  # another key too: ids are one space
        engine.begin_prefill(request, owner="b")
    engine.abandon(first)
    assert_consistent(runtime, engine)
    opened, _ = open_session(engine, list(range(2, 12)), session_id=session_id)  # free again
    assert opened.session_id == engine.session(session_id, "a").session_id == session_id
    assert_consistent(runtime, engine)
