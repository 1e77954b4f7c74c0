"""The draft model's rows under the verifier's rules: penalties counted on the generated
tokens and drafts, the grammar's state following the tokens drafted from."""

from __future__ import annotations

import numpy as np

from drafter.drafters.draft_rules import DraftRules
from server.shared.protocol import SamplingParams


class Recorded:
    """A grammar that allows every token but remembers what it was fed."""

    def __init__(self, refuse: int = -1):
        self.state: list[int] = []
        self.refuse = refuse

    def commit(self, tokens):
        if tokens[0] == self.refuse:
            raise ValueError("not allowed")
        self.state += tokens
        return lambda: self.state.pop()

    def mask_rows(self, logits, draft_tokens):
        out = logits.copy()
        out[:, 0] = -np.inf  # something to see
        return out


def test_the_grammar_state_follows_the_tokens_by_common_prefix():
    grammar = Recorded()
    rules = DraftRules(SamplingParams(), grammar, prompt_len=2)
    row = np.zeros(4, dtype=np.float32)
    assert rules.row(row, [9, 9, 1, 2])[0] == -np.inf
    assert grammar.state == [1, 2]
    rules.row(row, [9, 9, 1, 3, 3])  # the draft 2 was rejected: rolled back, then 3, 3
    assert grammar.state == [1, 3, 3]
    rules.row(row, [9, 9])
    assert grammar.state == []


def test_a_token_the_grammar_refuses_leaves_the_row_free_and_the_state_before_it():
    grammar = Recorded(refuse=3)
    rules = DraftRules(SamplingParams(), grammar, prompt_len=0)
    row = rules.row(np.zeros(4, dtype=np.float32), [1, 3])
    assert row[0] == 0 and grammar.state == [1]


def test_penalties_count_the_generated_tokens_not_the_prompt():
    rules = DraftRules(SamplingParams(presence_penalty=1.0), None, prompt_len=2)
    row = rules.row(np.zeros(4, dtype=np.float32), [1, 1, 2])
    assert row.tolist() == [0, 0, -1, 0]
