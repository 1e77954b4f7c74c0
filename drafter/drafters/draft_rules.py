"""What the verifier does to its rows, done to the draft model's too, so that drafts follow
it: penalties and logit biases (server/shared/penalties.py) and the grammar
(server/shared/constraint.py), each row after the committed tokens and the drafts before
it. Only acceptance is at stake here, never the output: the verifier applies its own."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from server.shared.penalties import adjusted_rows
from server.shared.prefix import common_prefix_len
from server.shared.protocol import Grammar, SamplingParams


class DraftRules:
    """One generation's: its sampling's penalties and biases, and its grammar's state
    (`constraint`, None without a grammar), which follows the tokens drafted from by
    longest common prefix (a round's drafts rolled back once it is judged)."""

    def __init__(self, sampling: SamplingParams, constraint, prompt_len: int):
        self.sampling = sampling
        self.constraint = constraint
        self.prompt_len = prompt_len
        self._consumed: list[int] = []  # generated tokens the grammar's state is after
        self._undo: list = []  # one undo per consumed token

    def row(self, logits: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
        """The draft model's row after `tokens` (the prompt, then generated and drafted)."""
        generated = list(tokens[self.prompt_len :])
        row = adjusted_rows(logits[None], self.sampling, generated, [])[0]
        if self.constraint is None:
            return row
        if not self._follow(generated):
            return row  # a token the grammar forbids was committed: the verifier's to judge
        try:
            return self.constraint.mask_rows(row[None], [])[0]
        except ValueError:  # the grammar failed here: drafts go free, the verifier judges
            return row

    def _follow(self, generated: list[int]) -> bool:
        keep = common_prefix_len(self._consumed, generated)
        while len(self._consumed) > keep:
            self._consumed.pop()
            self._undo.pop()()
        for token in generated[keep:]:
            try:
                self._undo.append(self.constraint.commit([token]))
            except ValueError:
                return False
            self._consumed.append(token)
        return True


def rules_for(
    context, sampling: SamplingParams, grammar: Grammar | None, prompt_len: int
) -> DraftRules | None:
    """A generation's rules for a draft context's sequences, None where there are none to
    follow. Not through a translated vocabulary (its ids are not ours), nor without
    llguidance installed (drafts then break the grammar more often; the verifier still
    keeps to it)."""
    if context.vocab_relation == "translated":
        return None
    constraint = None
    if grammar is not None:
        try:
            constraint = context.grammars().constraint(grammar.kind, grammar.source)
        except (ImportError, ValueError):
            constraint = None
    if constraint is None and not sampling.adjusts_logits:
        return None
    return DraftRules(sampling, constraint, prompt_len)
