"""One key cannot disturb another: not by taking its sequences, not by filling the queue,
not by a long prompt (fake runtime, cycles driven by hand: orders, never timings)."""

from __future__ import annotations

import asyncio
import threading

from server.shared.protocol import GenerateRequest, PrefillRequest, VerifyRequest
from server.verifier.errors import ServerFull
from server.verifier.scheduling.service import TEXTS_PER_KEY, VerifierService
from tests.fixtures.fake_runtime import FakeRuntime
from tests.fixtures.stepped import make_engine, prefilled, stepped_scheduler
from tests.unit.test_engine_races import assert_consistent

MAX_DRAFT = 4


def build(max_sessions: int = 4, max_queue: int = 64, prompt_chunk: int = 0, **engine):
    runtime = FakeRuntime(n_seq_max=max_sessions, n_batch=256, n_ctx_per_seq=512)
    engine = make_engine(
        runtime,
        max_draft=MAX_DRAFT,
        prefix_cache_min_tokens=4,
        prompt_chunk=prompt_chunk,
        **engine,
    )
    return runtime, engine, stepped_scheduler(engine, max_queue=max_queue)


async def answers_cross() -> None:
    """An answer set on the engine's side reaches its awaiting task in a few steps of the
    event loop (a thread-safe future, shielded)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def until_answered(scheduler, *tasks) -> None:
    """Run passes, one at a time, until every task has its answer."""
    while not all(task.done() for task in tasks):
        scheduler.run_step()
        await answers_cross()


async def opened(scheduler, prompt: str, owner: str) -> dict:
    task = asyncio.ensure_future(prefilled(scheduler, PrefillRequest(prompt=prompt), owner))
    await asyncio.sleep(0)
    await until_answered(scheduler, task)
    response = task.result()
    return {"id": response.session_id, "ids": response.prompt_ids, "n_past": response.total_tokens}


async def one_round(scheduler, session: dict, owner: str) -> list[int]:
    task = asyncio.ensure_future(
        scheduler.verify(VerifyRequest(session_id=session["id"], n_past=session["n_past"]), owner)
    )
    await asyncio.sleep(0)
    await until_answered(scheduler, task)
    session["n_past"] = task.result().total_tokens
    return task.result().tokens


def test_a_key_opening_sessions_by_the_dozen_takes_only_from_itself():
    runtime, engine, scheduler = build(max_sessions=4)

    async def scenario():
        alice = await opened(scheduler, "alice's one session", "alice")
        for i in range(12):
            await opened(scheduler, f"mallory's session number {i}", "mallory")
        assert_consistent(runtime, engine)
        assert engine.session(alice["id"], "alice")  # still there
        assert engine.sessions.held() == {"alice": 1, "mallory": 3}
        expected = runtime.reference_greedy(alice["ids"], 1)
        assert await one_round(scheduler, alice, "alice") == expected

    asyncio.run(scenario())


def test_a_keys_cached_prefix_within_its_share_outlives_another_keys_flood():
    runtime, engine, scheduler = build(max_sessions=4)

    async def scenario():
        alice = await opened(scheduler, "a long conversation of alice's, kept for later", "alice")
        await one_round(scheduler, alice, "alice")
        engine.sessions.delete(alice["id"], "alice")
        for i in range(8):
            await opened(scheduler, f"mallory floods the table {i}", "mallory")
        assert [p.owner for p in engine.sessions.cached_prefixes.values()] == ["alice"]
        prompt = "a long conversation of alice's, kept for later"
        task = asyncio.ensure_future(prefilled(scheduler, PrefillRequest(prompt=prompt), "alice"))
        await asyncio.sleep(0)
        await until_answered(scheduler, task)
        assert task.result().cached_tokens == task.result().prompt_len - 1  # all reused
        assert_consistent(runtime, engine)

    asyncio.run(scenario())


def test_a_key_within_its_share_takes_from_the_key_over_it():
    runtime, engine, scheduler = build(max_sessions=4)

    async def scenario():
        mallory = [await opened(scheduler, f"mallory {i}", "mallory") for i in range(3)]
        alice = await opened(scheduler, "alice first", "alice")
        # Full: alice (1 of an equal share of 2) takes mallory's least recently used.
        await opened(scheduler, "alice second", "alice")
        assert engine.sessions.held() == {"alice": 2, "mallory": 2}
        assert [s.session_id for s in engine.sessions.sessions() if s.owner == "mallory"] == [
            m["id"] for m in mallory[1:]
        ]
        assert engine.session(alice["id"], "alice")
        assert_consistent(runtime, engine)

    asyncio.run(scenario())


def test_a_fixed_share_binds_only_when_no_sequence_is_free():
    runtime, engine, scheduler = build(max_sessions=4, key_share=1)

    async def scenario():
        first = [await opened(scheduler, f"mallory {i}", "mallory") for i in range(4)]
        assert engine.sessions.held() == {"mallory": 4}  # free ones were there to take
        await opened(scheduler, "alice", "alice")
        assert engine.sessions.held() == {"alice": 1, "mallory": 3}
        # Both over a share of one now: the key furthest over gives first.
        await opened(scheduler, "alice again", "alice")
        assert engine.sessions.held() == {"alice": 2, "mallory": 2}
        await opened(scheduler, "alice a third time", "alice")  # as far over: her own
        assert engine.sessions.held() == {"alice": 2, "mallory": 2}
        assert engine.session(first[-1]["id"], "mallory")
        assert_consistent(runtime, engine)

    asyncio.run(scenario())


def test_cached_prefixes_expire_after_their_ttl():
    runtime, engine, _ = build()
    work = engine.begin_prefill(PrefillRequest(prompt="a prefix worth keeping"), owner="a")
    while not work.closed:
        engine.run([], [work])
    engine.sessions.delete(work.session.session_id, "a")
    assert len(engine.sessions.cached_prefixes) == 1
    assert engine.sessions.expire(600.0, 600.0) == [] and len(engine.sessions.cached_prefixes) == 1
    engine.sessions.expire(600.0, -1.0)
    assert engine.sessions.cached_prefixes == {}
    assert_consistent(runtime, engine)


def test_a_flooding_key_gets_503_before_another_keys_round_is_refused():
    runtime, engine, scheduler = build(max_sessions=4, max_queue=8)

    async def scenario():
        alice = await opened(scheduler, "alice's session", "alice")
        flood = [
            asyncio.ensure_future(
                prefilled(scheduler, PrefillRequest(prompt=f"flood {i}"), "mallory")
            )
            for i in range(8)
        ]
        await asyncio.sleep(0)
        refused = [task for task in flood if task.done()]
        assert len(refused) == 4 and all(isinstance(t.exception(), ServerFull) for t in refused)
        assert scheduler.queue_depth == 4  # half the queue: mallory's part while others wait
        tokens = await one_round(scheduler, alice, "alice")  # admitted, and answered
        assert tokens == runtime.reference_greedy(alice["ids"], 1)
        await until_answered(scheduler, *flood)

    asyncio.run(scenario())
    assert_consistent(runtime, engine, scheduler)


def test_a_key_flooding_the_text_pool_is_refused_past_its_part_and_another_key_is_not():
    """Prompt texts are tokenized in a small pool: one key may have TEXTS_PER_KEY there,
    so another key's text waits behind no more than that many of the flood's."""
    runtime, engine, scheduler = build(max_sessions=8)
    gate = threading.Event()
    tokenize = runtime.tokenize

    def slow_for_mallory(text: str, **kwargs) -> list[int]:
        if text.startswith("flood"):
            gate.wait()
        return tokenize(text, **kwargs)

    runtime.tokenize = slow_for_mallory
    service = VerifierService(scheduler)

    async def scenario():
        flood = [
            asyncio.ensure_future(service.prefill(PrefillRequest(prompt=f"flood {i}"), "mallory"))
            for i in range(TEXTS_PER_KEY + 2)
        ]
        await asyncio.sleep(0)
        refused = [task for task in flood if task.done()]
        assert len(refused) == 2 and all(isinstance(t.exception(), ServerFull) for t in refused)
        alice = asyncio.ensure_future(service.prefill(PrefillRequest(prompt="alice"), "alice"))
        await asyncio.sleep(0)
        assert not alice.done()  # let in: behind mallory's texts, not refused
        gate.set()
        while not alice.done() or not all(task.done() for task in flood):
            scheduler.run_step()
            await asyncio.sleep(0.001)  # the pool's threads hand their results over
        assert alice.result().prompt_ids == tokenize("alice", add_special=True)
        assert sum(task.exception() is None for task in flood) == TEXTS_PER_KEY

    try:
        asyncio.run(scenario())
    finally:
        gate.set()
        service.close()
    assert_consistent(runtime, engine, scheduler)


def test_an_admitted_generation_is_never_refused_halfway_by_its_own_keys_queue():
    """/generate's steps after its prompt belong to a request already let in: another
    request of the same key queued between two steps fills the key's part of the queue,
    and that must refuse newcomers, never the generation halfway through its work."""
    runtime, engine, scheduler = build(max_sessions=4, max_queue=2)

    async def scenario():
        generation = asyncio.ensure_future(
            VerifierService(scheduler).generate(
                GenerateRequest(prompt="count with me", max_tokens=4), "anonymous"
            )
        )
        await asyncio.sleep(0)
        scheduler.run_step()  # its prompt
        await answers_cross()
        assert scheduler.queue_depth == 1  # its first step
        scheduler.run_step()  # answered; the generation has not sent its next step yet
        newcomer = asyncio.ensure_future(prefilled(scheduler, PrefillRequest(prompt="another")))
        await asyncio.sleep(0)
        assert not newcomer.done() and scheduler.queue_depth == 1  # let in: nothing queued
        late = asyncio.ensure_future(prefilled(scheduler, PrefillRequest(prompt="one more")))
        await asyncio.sleep(0)
        assert late.done() and isinstance(late.exception(), ServerFull)  # the key's part
        await answers_cross()  # the generation's next step, behind the newcomer
        assert not generation.done() and scheduler.queue_depth == 2
        await until_answered(scheduler, generation)
        answer = generation.result()  # every step let in: no 503 halfway
        assert answer.tokens == runtime.reference_greedy(answer.prompt_ids, 4)
        await until_answered(scheduler, newcomer)
        engine.sessions.delete(newcomer.result().session_id, "anonymous")

    asyncio.run(scenario())
    assert_consistent(runtime, engine, scheduler)


def test_however_many_keys_flood_the_queue_another_keys_round_gets_in():
    runtime, engine, scheduler = build(max_sessions=4, max_queue=12)

    async def scenario():
        dave = await opened(scheduler, "dave's session", "dave")
        flood = [
            asyncio.ensure_future(prefilled(scheduler, PrefillRequest(prompt=f"{key} {i}"), key))
            for key in ("amy", "bob", "cat")
            for i in range(12)
        ]
        await asyncio.sleep(0)
        assert scheduler.queue_depth >= 12  # the queue is full of the three keys' work
        tokens = await one_round(scheduler, dave, "dave")  # admitted, and answered
        assert tokens == runtime.reference_greedy(dave["ids"], 1)
        await until_answered(scheduler, *flood)
        for task in flood:
            assert task.exception() is None or isinstance(task.exception(), ServerFull)

    asyncio.run(scenario())
    assert_consistent(runtime, engine, scheduler)


def test_a_key_within_its_share_gives_up_its_own_prefix_when_the_others_are_busy():
    runtime, engine, scheduler = build(max_sessions=4)

    async def scenario():
        bob = [await opened(scheduler, f"bob's session {i}", "bob") for i in range(3)]
        alice = await opened(scheduler, "alice's earlier conversation", "alice")
        engine.sessions.delete(alice["id"], "alice")  # kept as alice's cached prefix
        rounds = [
            asyncio.ensure_future(
                scheduler.verify(VerifyRequest(session_id=b["id"], n_past=b["n_past"]), "bob")
            )
            for b in bob
        ]
        prompt = asyncio.ensure_future(
            prefilled(scheduler, PrefillRequest(prompt="something else entirely"), "alice")
        )
        await asyncio.sleep(0)
        # Bob's rounds begin first: none of his sessions is idle.
        await until_answered(scheduler, prompt, *rounds)
        assert prompt.result().cached_tokens == 0
        assert engine.sessions.cached_prefixes == {}  # alice's own prefix made the room
        assert engine.sessions.held() == {"alice": 1, "bob": 3}
        assert all(r.exception() is None for r in rounds)

    asyncio.run(scenario())
    assert_consistent(runtime, engine, scheduler)


def test_a_round_waits_at_most_one_chunk_of_another_keys_long_prompt():
    runtime, engine, scheduler = build(max_sessions=4, prompt_chunk=16)

    async def scenario():
        alice = await opened(scheduler, "alice decodes steadily", "alice")
        alice_seq = engine.session(alice["id"]).seq_id
        long_prompt = asyncio.ensure_future(
            prefilled(scheduler, PrefillRequest(prompt="x" * 200), "mallory")
        )
        await asyncio.sleep(0)
        expected = runtime.reference_greedy(alice["ids"], 8)
        out: list[int] = []
        for _ in range(8):
            task = asyncio.ensure_future(
                scheduler.verify(
                    VerifyRequest(session_id=alice["id"], n_past=alice["n_past"]), "alice"
                )
            )
            await asyncio.sleep(0)
            first = len(runtime.decodes)
            scheduler.run_step()  # alice's round
            await answers_cross()
            assert task.done()  # answered in the very step it was queued in
            scheduler.run_step()  # then one chunk of the prompt
            decoded = [{e.seq_id for e in d} for d in runtime.decodes[first:]]
            assert decoded[0] == {alice_seq} and len(decoded) == 2  # the round, one chunk
            out += task.result().tokens
            alice["n_past"] = task.result().total_tokens
        assert out == expected
        assert not long_prompt.done()  # 200 tokens: more chunks than alice's 8 cycles
        await until_answered(scheduler, long_prompt)

    asyncio.run(scenario())
    assert_consistent(runtime, engine, scheduler)


def test_two_keys_long_prompts_take_turns_chunk_by_chunk():
    runtime, engine, scheduler = build(max_sessions=4, prompt_chunk=16)

    async def scenario():
        owners = ["mallory", "mallory", "alice"]  # mallory queued two prompts, then alice
        first = len(runtime.decodes)
        tasks = [
            asyncio.ensure_future(prefilled(scheduler, PrefillRequest(prompt=c * 80), owner))
            for c, owner in zip("abc", owners, strict=True)
        ]
        await asyncio.sleep(0)
        await until_answered(scheduler, *tasks)
        owner_of = {s.seq_id: s.owner for s in engine.sessions.sessions()}
        order = [owner_of[d[0].seq_id] for d in runtime.decodes[first:]]
        # 80 tokens: five chunks each. By key in turn, alice's five come first of every
        # two, ahead of mallory's second prompt.
        assert len(order) == 15
        assert order[:10] == ["mallory", "alice"] * 5

    asyncio.run(scenario())
    assert_consistent(runtime, engine, scheduler)


def test_a_hundred_rounds_of_one_key_do_not_hold_up_another_keys_one():
    runtime, engine, scheduler = build(max_sessions=16)

    async def scenario():
        sessions = [await opened(scheduler, f"mallory {i}", "mallory") for i in range(15)]
        alice = await opened(scheduler, "alice", "alice")
        tasks = [
            asyncio.ensure_future(
                scheduler.verify(VerifyRequest(session_id=s["id"], n_past=s["n_past"]), owner)
            )
            for s, owner in [*((s, "mallory") for s in sessions), (alice, "alice")]
        ]
        await asyncio.sleep(0)
        scheduler.run_step()
        await answers_cross()
        assert all(task.done() for task in tasks)  # every round of every key: one cycle
        assert tasks[-1].result().tokens == runtime.reference_greedy(alice["ids"], 1)

    asyncio.run(scenario())
    assert_consistent(runtime, engine, scheduler)
