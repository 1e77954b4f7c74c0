"""The draft context shared by `serve`'s generations, on the fake runtime: decodes from
several threads are grouped into one batch (group commit) only where they may be, each
gets its own sequence's logits, and a failed shared decode leaves no sequence changed.

Batches are made deterministic by holding the context busy while requests queue up."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from drafter.drafters.draft_context import DraftContext, _Decode
from drafter.errors import DraftModelError
from tests.fixtures.fake_runtime import FakeRuntime


def hold(ctx: DraftContext) -> None:
    with ctx._cond:
        ctx._busy = True


def release_when_queued(ctx: DraftContext, n: int) -> None:
    """Once `n` requests wait, let the context go: the first woken takes them together."""
    with ctx._cond:
        while len(ctx._queue) < n:
            ctx._cond.wait(timeout=0.01)
        ctx._busy = False
        ctx._cond.notify_all()


def decode_in_threads(ctx: DraftContext, requests: list[tuple[int, list[int], bool]]):
    results: dict[int, np.ndarray | Exception] = {}

    def run(i: int, seq_id: int, tokens: list[int], alone: bool) -> None:
        try:
            results[i] = ctx.decode(seq_id, tokens, len(ctx.runtime.cells[seq_id]), alone=alone)
        except Exception as exc:
            results[i] = exc

    threads = [
        threading.Thread(target=run, args=(i, *request)) for i, request in enumerate(requests)
    ]
    hold(ctx)
    for thread in threads:
        thread.start()
    release_when_queued(ctx, len(requests))
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()
    return [results[i] for i in range(len(requests))]


def test_queued_drafts_of_different_sequences_share_one_decode_with_their_own_logits():
    runtime = FakeRuntime(n_batch=16)
    ctx = DraftContext(runtime)
    rows = decode_in_threads(ctx, [(0, [5], False), (1, [6, 7], False), (2, [8], False)])
    assert ctx.decodes == 1 and ctx.shared_decodes == 1
    assert runtime.cells == {0: [5], 1: [6, 7], 2: [8], 3: []}
    for seq_id, row in enumerate(rows):
        assert np.array_equal(row, runtime.logits_after(runtime.cells[seq_id]))


def test_a_request_asking_to_be_alone_never_shares_a_decode():
    runtime = FakeRuntime(n_batch=16)
    ctx = DraftContext(runtime)
    rows = decode_in_threads(ctx, [(0, [5], True), (1, [6], False)])
    assert ctx.decodes == 2 and ctx.shared_decodes == 0
    for seq_id, row in enumerate(rows):
        assert np.array_equal(row, runtime.logits_after(runtime.cells[seq_id]))


def test_take_keeps_arrival_order_one_request_per_sequence_and_n_batch():
    ctx = DraftContext(FakeRuntime(n_batch=4))
    a, b, c, d = (_Decode(s, [3] * n, 0, False) for s, n in ((0, 1), (1, 2), (0, 1), (2, 1)))
    ctx._queue.extend([a, b, c, d])
    assert ctx._take() == [a, b]  # c is seq 0 again: it and what follows wait
    assert ctx._take() == [c, d]
    big, small = _Decode(0, [3] * 3, 0, False), _Decode(1, [3] * 2, 0, False)
    ctx._queue.extend([big, small])
    assert ctx._take() == [big]  # 3 + 2 tokens exceed n_batch = 4
    assert ctx._take() == [small]
    alone, other = _Decode(0, [3], 0, True), _Decode(1, [3], 0, False)
    ctx._queue.extend([other, alone])
    assert ctx._take() == [other]


def test_a_failed_shared_decode_is_retried_alone_and_fails_only_the_request_at_fault():
    runtime = FakeRuntime(n_batch=16)
    ctx = DraftContext(runtime)
    ctx.decode(0, [2, 3], 0)
    runtime.fail_decode = lambda entries: any(e.seq_id == 1 for e in entries)
    ok, failed = decode_in_threads(ctx, [(0, [5], False), (1, [6], False)])
    assert isinstance(failed, Exception)
    assert np.array_equal(ok, runtime.logits_after([2, 3, 5]))
    assert runtime.cells[0] == [2, 3, 5] and runtime.cells[1] == []
    runtime.fail_decode = None
    row = ctx.decode(1, [6], 0)  # and the failed sequence starts again from where it was
    assert np.array_equal(row, runtime.logits_after([6]))


def test_a_long_prompt_goes_n_batch_at_a_time_and_lets_other_drafts_in_between():
    runtime = FakeRuntime(n_batch=16)
    ctx = DraftContext(runtime)
    prompt = [2 + i % 50 for i in range(40)]
    results = {}

    def run(name: str, seq_id: int, tokens: list[int]) -> None:
        results[name] = ctx.decode(seq_id, tokens, 0)

    hold(ctx)
    threads = [
        threading.Thread(target=run, args=("long", 0, prompt)),
        threading.Thread(target=run, args=("draft", 1, [7])),
    ]
    for n, thread in enumerate(threads, start=1):  # queued in this order
        thread.start()
        with ctx._cond:
            while len(ctx._queue) < n:
                ctx._cond.wait(timeout=0.01)
    release_when_queued(ctx, 2)
    for thread in threads:
        thread.join(timeout=30)
    assert [len(entries) for entries in runtime.decodes] == [16, 1, 16, 8]
    assert np.array_equal(results["long"], runtime.logits_after(prompt))
    assert np.array_equal(results["draft"], runtime.logits_after([7]))


def test_a_closed_context_refuses_work():
    ctx = DraftContext(FakeRuntime())
    ctx.close()
    assert ctx.runtime.closed
    with pytest.raises(DraftModelError):
        ctx.decode(0, [3], 0)
    with pytest.raises(DraftModelError):
        ctx.remove(0, -1)


def test_a_long_prompt_is_cut_to_n_batch_and_decoded_alone():
    runtime = FakeRuntime(n_batch=8)
    ctx = DraftContext(runtime)
    prompt = [2 + i % 50 for i in range(30)]
    row = ctx.decode(0, prompt, 0)
    assert runtime.cells[0] == prompt
    assert np.array_equal(row, runtime.logits_after(prompt))
    assert all(len(entries) <= 8 for entries in runtime.decodes)
    with pytest.raises(ValueError):
        ctx.decode(0, [], 30)
