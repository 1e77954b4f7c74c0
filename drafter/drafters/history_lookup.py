"""Drafts from the user's other requests only, for the draft model's side
(`--drafter model+history`).

Where a session's own text repeats, the verifier copies the repeat inside its chunks
(its /info `chunk_copy_ngram`: a step drafts what followed the session's last that many
tokens where they occurred earlier), at no round trip; a client's lookup of the same text
would only add round trips. What the verifier cannot see is the user's other requests: a
question asked again in a new conversation, a file an earlier session wrote, the answer
an agent's retried step gave before. So this drafter drafts nothing where the session's
text ends in a repeat of `chunk_copy_ngram` tokens (which the verifier copies where a
copy pays and a draft is judged without its probabilities: the runner passes 0 under
rejection sampling), and otherwise the suffix drafter's chain
(drafter/drafters/suffix.py) from the user's history alone, on a match of at least
`min_match` tokens (as long a repeat as the verifier's copies wait for: a chance match
of a few tokens in text that does not repeat is seldom followed), carrying its
estimated acceptance as the suffix drafter's drafts do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from drafter.drafters.suffix import SuffixDrafter, SuffixHistory, suffix_match
from drafter.speculative.candidates import Draft
from server.shared.repeats import copy_source

# The verifier's copies wait for a 12-token repeat (llama.cpp's ngram-simple default):
# a match in the history as long earns a draft.
HISTORY_MIN_MATCH = 12


class HistoryLookup(SuffixDrafter):
    """The suffix drafter over `history` alone, where the verifier does not copy from the
    session's own text (`copy_ngram`: its /info `chunk_copy_ngram`; 0: it never does)."""

    def __init__(
        self,
        n_vocab: int,
        history: SuffixHistory | None = None,
        *,
        copy_ngram: int,
        min_match: int = HISTORY_MIN_MATCH,
        sample_drafts: bool = False,
        sized: bool = False,
    ):
        super().__init__(n_vocab, history, sample_drafts=sample_drafts, sized=sized)
        self.copy_ngram = copy_ngram
        self.min_match = min_match

    def get_candidates(
        self, committed: Sequence[int], k: int, stop: Callable[[], bool] | None = None
    ) -> Draft:
        if self._verifier_copies(committed):
            return Draft([], None, lookup=True)
        with self.history.lock:
            tokens, match = suffix_match(committed, [self.history.index.occurrences], k, self.rules)
            if match < self.min_match:
                return Draft([], None, lookup=True)
            accept = self.history.acceptance.rate(match) if self.sized else None
        probs = [self._point_mass(t) for t in tokens] if self.sample_drafts else None
        return Draft(tokens, probs, lookup=True, accept=accept, match=match)

    def _verifier_copies(self, committed: Sequence[int]) -> bool:
        """Whether the session's last `copy_ngram` tokens occurred earlier in its own text,
        with something after them: the verifier's chunks copy from there."""
        return copy_source(committed, self.copy_ngram) is not None
