"""A round under a grammar that fails after the verdict leaves no trace: the tokens handed
to the grammar (for its next masks to consume), the session and its KV sequence stay as
they were (finish_round alone, a stand-in grammar; the real grammar's side is in
tests/integration/test_hostile_grammars.py)."""

from __future__ import annotations

import numpy as np
import pytest

from server.shared.protocol import SamplingParams, Strategy
from server.shared.sampling import PositionDraws
from server.verifier.decoding.jobs import VerifyWork
from server.verifier.decoding.rounds import finish_round
from server.verifier.kv.sessions import Session


class Recorded:
    """Allows every token; remembers what it was handed."""

    token_limit = None  # no bound on the tokens it allows

    def __init__(self):
        self.state: list[int] = []

    def row_masks(self, draft_tokens, row_budget_s=0.0):
        return None

    def apply_masks(self, logits, masks):
        return logits

    def defer(self, tokens):
        self.state += tokens
        return lambda: [self.state.pop() for _ in tokens]


def a_round(grammar) -> tuple[Session, VerifyWork, list]:
    session = Session(
        session_id="s" * 22,
        seq_id=0,
        tokens=[1, 2, 3],
        prompt_len=3,
        sampling=SamplingParams(),
        strategy=Strategy.greedy,
        threshold=None,
        draws=PositionDraws(0),
        constraint=grammar,
    )
    work = VerifyWork(session, [5, 6], None, start=2, round_key=("k",))
    session.work = work
    return session, work, []


def logits() -> np.ndarray:
    rows = np.zeros((3, 8), dtype=np.float32)
    rows[0, 5] = rows[1, 6] = rows[2, 7] = 1.0  # every draft accepted, then 7
    return rows


def test_a_step_failing_after_the_grammar_took_the_tokens_undoes_them():
    grammar = Recorded()
    session, work, _ = a_round(grammar)

    def failing_trim(*_):
        raise RuntimeError("the KV trim failed")

    with pytest.raises(RuntimeError):
        finish_round(work, logits(), 0.0, remove=failing_trim, is_eog=lambda t: False,
                     lossless=True)  # fmt: skip
    assert session.tokens == [1, 2, 3] and grammar.state == []
    finish_round(work, logits(), 0.0, remove=lambda *a: None, is_eog=lambda t: False,
                 lossless=True)  # fmt: skip
    assert grammar.state == [5, 6, 7] and session.tokens == [1, 2, 3, 5, 6, 7]
