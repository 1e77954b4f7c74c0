"""A round under a grammar begins only once its masks are computed, off the engine thread:
the step answers every other session meanwhile, and answers the constrained round, masked,
in a later step (cycle.py `_masks_ready`). The mask threads serve keys in turn, each key's
tasks one at a time (keyed_pool.py). Behaviour only: futures completed by hand, tasks
that block on events."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future

import numpy as np
import pytest

from server.verifier.decoding.rounds import grammar_step
from server.verifier.errors import InvalidGrammar, ServerFull
from server.verifier.scheduling.cycle import CycleStep, Job
from server.verifier.scheduling.keyed_pool import GRAMMAR_NICE, KeyedPool
from tests.fixtures.fake_runtime import FakeRuntime
from tests.fixtures.invariants import check_engine
from tests.fixtures.stepped import make_engine
from tests.unit.test_cycle import open_session, round_job


class OnlyTokens:
    """A grammar allowing `allowed` tokens anywhere: its masks, its commits."""

    token_limit = None  # no bound on the tokens it allows

    def __init__(self, allowed: set[int], n_vocab: int, fail: str | None = None):
        self.allowed, self.n_vocab, self.fail = allowed, n_vocab, fail
        self.committed: list[int] = []
        self.computed = 0

    def row_masks(self, draft_tokens, row_budget_s=0.0):
        self.computed += 1
        if self.fail:
            from server.shared.constraint import GrammarError

            raise GrammarError(self.fail)
        return np.array([sorted(self.allowed)] * (len(draft_tokens) + 1))

    def apply_masks(self, logits, masks):
        out = np.full_like(logits, -np.inf)
        for row, allowed in enumerate(masks[: len(logits)]):
            out[row, allowed] = logits[row, allowed]
        return out

    def defer(self, tokens):
        self.committed += tokens
        return lambda: [self.committed.pop() for _ in tokens]

    @property
    def finished(self) -> bool:
        return False


class HeldMasks:
    """A mask runner whose tasks run only when the test says."""

    def __init__(self):
        self.tasks: list[tuple[str, Future, object]] = []

    def __call__(self, owner, fn) -> Future:
        future: Future = Future()
        self.tasks.append((owner, future, fn))
        return future

    def run(self, i: int = -1) -> None:
        _, future, fn = self.tasks[i]
        try:
            future.set_result(fn())
        except Exception as exc:
            future.set_exception(exc)


def build():
    runtime = FakeRuntime(n_seq_max=4, n_batch=64, n_ctx_per_seq=256)
    masks = HeldMasks()
    return runtime, masks, CycleStep(make_engine(runtime, max_draft=4), masks=masks)


def test_a_round_waiting_for_its_masks_holds_no_other_session_and_is_answered_masked_after():
    runtime, masks, cycle = build()
    constrained = open_session(cycle, "under a grammar", owner="mallory")
    plain = open_session(cycle, "no grammar", owner="alice")
    allowed = {5, 9}
    grammar = OnlyTokens(allowed, runtime.n_vocab)
    constrained.session.constraint = grammar
    expected_plain = runtime.reference_greedy(plain.response.prompt_ids, 2)

    slow, other = round_job(constrained, [5], "mallory"), round_job(plain, [], "alice")
    step = cycle.step([slow, other])
    assert [job for job, _ in step.answers] == [other]  # the other session answered
    assert step.answers[0][1].tokens == expected_plain[:1]
    assert step.masks_awaited == 1 and len(masks.tasks) == 1 and grammar.computed == 0
    assert cycle.step([slow]).answers == [] and len(masks.tasks) == 1  # asked once

    masks.run()
    ((job, answer),) = cycle.step([slow]).answers
    assert job is slow and all(t in allowed for t in answer.tokens)
    assert grammar.committed == answer.tokens and grammar.computed == 1
    check_engine(cycle.engine)


def test_masks_that_fail_answer_the_round_400_and_leave_the_session_as_it_was():
    runtime, masks, cycle = build()
    opened = open_session(cycle, "under a grammar")
    opened.session.constraint = OnlyTokens({5}, runtime.n_vocab, fail="too slow for its row")
    tokens_before = list(opened.session.tokens)
    job = round_job(opened, [5, 5])
    assert cycle.step([job]).answers == []
    masks.run()
    ((_, answer),) = cycle.step([job]).answers
    assert isinstance(answer, InvalidGrammar) and "too slow for its row" in str(answer)
    assert opened.session.tokens == tokens_before and opened.session.work is None
    check_engine(cycle.engine)


def test_a_replayed_or_stale_round_is_answered_without_masks():
    runtime, masks, cycle = build()
    opened = open_session(cycle, "under a grammar")
    opened.session.constraint = OnlyTokens({5, 9}, runtime.n_vocab)
    first = round_job(opened, [])
    cycle.step([first])
    masks.run()
    ((_, answer),) = cycle.step([first]).answers
    replay = Job("a", first.session_id, request=first.request, round_key=first.round_key)
    ((_, again),) = cycle.step([replay]).answers  # the same round again: its record
    assert again == answer and len(masks.tasks) == 1
    stale = round_job(opened, [])
    stale.request = stale.request.model_copy(update={"n_past": 1})
    ((_, refused),) = cycle.step([stale]).answers  # 409, no masks computed for it
    assert getattr(refused, "status_code", None) == 409 and len(masks.tasks) == 1


def test_grammar_step_makes_a_grammar_failure_a_400():
    from server.shared.constraint import GrammarError

    def fails():
        raise GrammarError("a limit")

    with pytest.raises(InvalidGrammar, match="a limit"):
        grammar_step(fails)


def test_keys_take_turns_and_one_keys_slow_task_holds_one_thread():
    pool = KeyedPool(2, "test", per_owner=0)
    release, order = threading.Event(), []
    try:
        slow = [pool.submit("mallory", lambda: release.wait(60)) for _ in range(3)]
        # Mallory's first holds a thread, her others wait behind it: alice's task runs on
        # the other thread, and her next after it, while mallory's first still runs.
        alice = [pool.submit("alice", lambda i=i: order.append(i)) for i in range(2)]
        assert [f.result(timeout=60) for f in alice] == [None, None] and order == [0, 1]
        assert not slow[0].done() and not slow[1].running() and not slow[2].running()
    finally:
        release.set()
    assert all(f.result(timeout=60) for f in slow)
    pool.shutdown()


def test_one_thread_serves_keys_in_turn_and_a_keys_share_is_bounded():
    pool = KeyedPool(1, "test", per_owner=2)
    release, order = threading.Event(), []
    try:
        first = pool.submit("mallory", lambda: release.wait(60))
        queued = pool.submit("mallory", lambda: order.append("mallory"))
        with pytest.raises(ServerFull, match="2 grammar tasks"):
            pool.submit("mallory", lambda: None)
        alice = pool.submit("alice", lambda: order.append("alice"))
    finally:
        release.set()
    for future in (first, queued, alice):
        future.result(timeout=60)
    # After mallory's running task, alice's turn came before mallory's next.
    assert order == ["alice", "mallory"]
    pool.shutdown()


def test_the_pools_threads_run_below_the_engine():
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        pytest.skip("no per-thread priority here")
    pool = KeyedPool(1, "test", per_owner=0, nice=GRAMMAR_NICE)
    try:
        mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        theirs = pool.submit(
            "a", lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        ).result(timeout=60)
    finally:
        pool.shutdown()
    assert theirs == min(19, mine + GRAMMAR_NICE)
