"""The draft model's warming and catching up, stopped between pieces (fake runtime): a
stop leaves whole pieces in the cache, and the next call goes on from there."""

from __future__ import annotations

from drafter.drafters.draft_context import DraftContext
from drafter.drafters.model import PIECE_TOKENS, DraftModel
from drafter.speculative.warming import Warming
from server.shared.protocol import PrefillRequest
from tests.fixtures.fake_runtime import FakeRuntime

PROMPT = [1, *(2 + i % 60 for i in range(3 * PIECE_TOKENS + 5))]


def model() -> tuple[DraftModel, FakeRuntime]:
    runtime = FakeRuntime(n_vocab=64, n_ctx_per_seq=1024)
    return DraftModel.on(DraftContext(runtime), 0), runtime


def test_unstopped_the_whole_prompt_is_evaluated():
    draft, runtime = model()
    draft.warm(PrefillRequest(prompt_tokens=PROMPT, add_bos=False), lambda: False)
    assert runtime.cells[0] == PROMPT


def test_a_stopped_warming_keeps_one_piece_and_a_catch_up_goes_on_from_it():
    draft, runtime = model()
    draft.warm(PrefillRequest(prompt_tokens=PROMPT, add_bos=False), lambda: True)
    assert runtime.cells[0] == PROMPT[:PIECE_TOKENS]
    committed = [*PROMPT, 7, 8, 9]  # what rounds without a draft brought since
    assert draft.catch_up(committed, lambda: True) is False
    assert runtime.cells[0] == committed[: 2 * PIECE_TOKENS]
    evaluated = draft.decoded_tokens
    assert draft.catch_up(committed, lambda: False) is True
    assert runtime.cells[0] == committed
    assert draft.decoded_tokens == evaluated + len(committed) - 2 * PIECE_TOKENS
    assert draft.catch_up(committed, lambda: True) is True  # nothing left to do


def test_a_catch_up_cuts_back_what_the_committed_tokens_do_not_hold():
    draft, runtime = model()
    draft.warm(PrefillRequest(prompt_tokens=[*PROMPT, 40, 41], add_bos=False))
    assert draft.catch_up([*PROMPT, 30], lambda: True) is True
    assert runtime.cells[0] == [*PROMPT, 30]


def test_warming_stopped_from_the_loop_ends_and_a_catch_up_then_waits_for_it():
    draft, runtime = model()
    warming = Warming()
    warming.start(draft.warm, PrefillRequest(prompt_tokens=PROMPT, add_bos=False))
    warming.stop()
    assert warming.catch_up(draft, PROMPT, lambda: False) is True
    assert runtime.cells[0] == PROMPT
