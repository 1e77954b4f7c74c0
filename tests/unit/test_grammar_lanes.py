"""Grammars on the verifier's service (server/verifier/scheduling/service.py, issue 64):
compiles run one at a time, keys in turn, so another key's compile waits for one of a
flooding key's at most, never for her queue; and a copy of a grammar a key has compiled
already waits for no compile at all. A compile here blocks until the test releases it:
the order is the pools', never a race's. The scheduler is a stand-in that opens sessions."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from server.shared import grammars as grammars_module
from server.shared.grammars import GrammarLimits, Grammars
from server.shared.protocol import PrefillRequest, PrefillResponse
from server.verifier.errors import ServerFull
from server.verifier.scheduling.keyed_pool import KeyedPool
from server.verifier.scheduling.service import GRAMMARS_PER_KEY, VerifierService
from tests.fixtures.byte_grammar import END, TOKENIZER

WAIT_S = 60  # only a bound on a test gone wrong: nothing below waits on time


class OpeningScheduler:
    def __init__(self, grammars: Grammars):
        self.engine = SimpleNamespace(grammars=grammars)

    async def prefill(self, request, owner, constraint):
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
        while order[-1] != "m0+":  # her first compiling (and held there)
            await asyncio.sleep(0)
        floods.append(asyncio.ensure_future(service.prefill(grammar("m1+"), "mallory")))
        while len(pool._tasks.get("mallory", ())) < 1:  # her second waiting behind it
            await asyncio.sleep(0)
        with pytest.raises(ServerFull):  # past her share: refused, not queued
            await service.prefill(grammar("m2+"), "mallory")
        # Alice's compiled grammar: a copy, answered while mallory's compile still runs.
        await asyncio.wait_for(service.prefill(grammar("alice+"), "alice"), WAIT_S)
        assert not release.is_set() and order == ["alice+", "m0+"]
        new = asyncio.ensure_future(service.prefill(grammar("bob+"), "alice"))
        while "alice" not in pool._tasks:
            await asyncio.sleep(0)
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
