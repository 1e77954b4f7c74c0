"""Grammars on the verifier's service (server/verifier/scheduling/service.py, issue 64):
compiles run one at a time, keys in turn, so another key's compile waits for one of a
flooding key's at most, never for her queue; and a copy of a grammar a key has compiled
already waits for no compile at all. A compile here blocks until the test releases it:
the order is the pools', never a race's. The scheduler is a stand-in that opens sessions."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from server.shared import constraint as constraint_module
from server.shared import grammars as grammars_module
from server.shared.constraint import GrammarTooSlow
from server.shared.grammars import GrammarLimits, Grammars
from server.shared.protocol import PrefillRequest, PrefillResponse
from server.verifier.errors import InvalidGrammar, ServerFull
from server.verifier.scheduling.keyed_pool import KeyedPool
from server.verifier.scheduling.service import GRAMMARS_PER_KEY, VerifierService
from tests.fixtures.byte_grammar import END, TOKENIZER

WAIT_S = 60  # only a bound on a test gone wrong: nothing below waits on time
SPINS = 60_000  # turns of the loop a condition may take (SPIN_S each): a bound, as WAIT_S
SPIN_S = 0.001


async def until(condition: Callable[[], bool], what: str) -> None:
    """The loop turned until `condition` holds, a bounded number of times: a regression
    fails, saying what never happened, instead of hanging."""
    for _ in range(SPINS):
        if condition():
            return
        await asyncio.sleep(SPIN_S)
    pytest.fail(f"never happened: {what}")


class OpeningScheduler:
    def __init__(self, grammars: Grammars, row_budget_s: float = 0.0):
        self.engine = SimpleNamespace(grammars=grammars, grammar_row_s=row_budget_s)
        self.constraints: list = []  # each session's grammar state, as opened

    async def prefill(self, request, owner, constraint):
        self.constraints.append(constraint)
        response = PrefillResponse(
            session_id="s" * 22, prompt_ids=request.prompt_tokens, prompt_len=2,
            total_tokens=2, strategy="greedy", lossless=True,
        )  # fmt: skip
        return SimpleNamespace(response=response, constraint=constraint)

    def close(self) -> None:
        pass


def grammar(source: str) -> PrefillRequest:
    return PrefillRequest(prompt_tokens=[1, 2], grammar={"kind": "regex", "source": source})


@pytest.fixture
def compiles(monkeypatch):
    """(what was compiled, in order; the event mallory's compiles wait for)."""
    order: list[str] = []
    release = threading.Event()
    real = grammars_module.compile_grammar

    def compile_grammar(kind, source, deadline=None):
        order.append(source)
        if source.startswith("m"):
            release.wait(WAIT_S)
        return real(kind, source, deadline)

    monkeypatch.setattr(grammars_module, "compile_grammar", compile_grammar)
    yield order, release
    release.set()


def test_a_keys_compile_waits_for_one_of_a_flooding_keys_and_a_copy_for_none(compiles):
    order, release = compiles
    service = VerifierService(OpeningScheduler(Grammars(lambda: TOKENIZER, END + 1)))
    pool = service._grammar_pool

    async def scenario() -> None:
        await service.prefill(grammar("alice+"), "alice")  # compiled once, before the flood
        floods = [asyncio.ensure_future(service.prefill(grammar("m0+"), "mallory"))]
        await until(lambda: order[-1] == "m0+", "mallory's first compile began")  # held there
        floods.append(asyncio.ensure_future(service.prefill(grammar("m1+"), "mallory")))
        waiting = lambda: len(pool._tasks.get("mallory", ())) >= 1  # noqa: E731
        await until(waiting, "mallory's second compile queued behind her first")
        with pytest.raises(ServerFull):  # past her share: refused, not queued
            await service.prefill(grammar("m2+"), "mallory")
        # Alice's compiled grammar: a copy, answered while mallory's compile still runs.
        await asyncio.wait_for(service.prefill(grammar("alice+"), "alice"), WAIT_S)
        assert not release.is_set() and order == ["alice+", "m0+"]
        new = asyncio.ensure_future(service.prefill(grammar("bob+"), "alice"))
        await until(lambda: "alice" in pool._tasks, "alice's new grammar queued")
        release.set()
        await asyncio.wait_for(asyncio.gather(new, *floods), WAIT_S)

    try:
        asyncio.run(scenario())
    finally:
        service.close()
    # Alice's new grammar compiled after mallory's running one, before her waiting one.
    assert order == ["alice+", "m0+", "bob+", "m1+"]
    assert GRAMMARS_PER_KEY == 2  # what the flood above was sized by


def test_one_thread_serves_a_keys_single_task_after_the_running_one_of_a_queue_of_five():
    pool = KeyedPool(1, "test", per_owner=0)
    release, order = threading.Event(), []
    try:
        first = pool.submit("mallory", lambda: (order.append("m0"), release.wait(WAIT_S)))
        rest = [pool.submit("mallory", lambda i=i: order.append(f"m{i}")) for i in range(1, 5)]
        alice = pool.submit("alice", lambda: order.append("alice"))
    finally:
        release.set()
    for future in (first, *rest, alice):
        future.result(timeout=WAIT_S)
    pool.shutdown()
    assert order == ["m0", "alice", "m1", "m2", "m3", "m4"]


def test_a_prefill_names_the_bound_of_a_grammar_whose_end_is_unproven():
    shelf = Grammars(lambda: TOKENIZER, END + 1, GrammarLimits(unproven_tokens=7))
    service = VerifierService(OpeningScheduler(shelf))
    unproven = 'start: "a" start | tail\ntail: %json {"type": "string"}'
    lark = PrefillRequest(prompt_tokens=[1, 2], grammar={"kind": "lark", "source": unproven})
    try:
        opened = asyncio.run(service.prefill(lark, "k"))
        plain = asyncio.run(service.prefill(grammar("a+"), "k"))
    finally:
        service.close()
    assert opened.grammar_token_limit == 7
    assert plain.grammar_token_limit is None and "grammar_token_limit" not in plain.model_dump()


def lanes_of(service: VerifierService) -> list[str]:
    """The pools the service submits to, in order, as it submits."""
    lanes: list[str] = []
    for name, pool in (("copy", service._copy_pool), ("compile", service._grammar_pool)):

        def submit(owner, fn, submit=pool.submit, name=name):
            lanes.append(name)
            return submit(owner, fn)

        pool.submit = submit
    return lanes


def reopened(source: str, generated: list[int]) -> PrefillRequest:
    return PrefillRequest(
        prompt_tokens=[1, 2, *generated],
        generated_tokens=len(generated),
        grammar={"kind": "regex", "source": source},
    )


def test_a_reopened_session_takes_its_tokens_in_the_compile_lane_never_the_copy_lane():
    """The copy lane's one thread only copies: a reopened session's state, which takes its
    generated tokens (as long as a slow grammar makes that), is prepared in the compile
    lane, keys in turn there, even where its key has the grammar compiled."""
    shelf = Grammars(lambda: TOKENIZER, END + 1)
    service = VerifierService(OpeningScheduler(shelf))
    lanes = lanes_of(service)
    a = ord("a")
    try:
        asyncio.run(service.prefill(grammar("a+"), "k"))  # compiled: no copy to take
        assert lanes == ["copy", "compile"]
        lanes.clear()
        asyncio.run(service.prefill(grammar("a+"), "k"))
        assert lanes == ["copy"]  # compiled already: copied
        lanes.clear()
        asyncio.run(service.prefill(reopened("a+", [a, a]), "k"))
        assert lanes == ["compile"]
    finally:
        service.close()
    assert service.scheduler.constraints[-1].generated == 2


class Ticks:
    """A clock that moves `step` seconds each time it is read."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_a_reopened_sessions_tokens_are_taken_within_the_row_budget(monkeypatch):
    monkeypatch.setattr(constraint_module, "clock", Ticks(1.0))  # each token: a second
    a = ord("a")
    slow = VerifierService(OpeningScheduler(Grammars(lambda: TOKENIZER, END + 1), 0.5))
    unlimited = VerifierService(OpeningScheduler(Grammars(lambda: TOKENIZER, END + 1), 0.0))
    try:
        with pytest.raises(InvalidGrammar, match="VERIFIER_GRAMMAR_ROW_MS") as refused:
            asyncio.run(slow.prefill(reopened("a+", [a, a, a]), "k"))
        assert "1 of 3 tokens" in str(refused.value)  # stopped at the first token over
        asyncio.run(unlimited.prefill(reopened("a+", [a, a, a]), "k"))
    finally:
        slow.close()
        unlimited.close()
    assert slow.scheduler.constraints == [] and unlimited.scheduler.constraints[0].generated == 3


def test_a_commit_over_its_budget_is_undone(monkeypatch):
    state = Grammars(lambda: TOKENIZER, END + 1).constraint("regex", "a+")
    monkeypatch.setattr(constraint_module, "clock", Ticks(1.0))
    with pytest.raises(GrammarTooSlow):
        state.commit([ord("a")] * 3, budget_s=0.5)
    assert state.generated == 0
    state.commit([ord("a")] * 3, budget_s=1.5)  # a second a token: within
    assert state.generated == 3
