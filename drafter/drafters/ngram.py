"""Drafting with no model: prompt lookup (n-gram matching), as in llama.cpp's
`common_ngram` drafts and vLLM's `[ngram]` speculator.

The last n committed tokens are looked up earlier in the committed text (the prompt
included); the tokens that followed the most recent earlier occurrence are the draft.
Longer n-grams are tried first. It costs microseconds and shines where the answer repeats
its input: editing code, rewriting text, quoting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from drafter.speculative.candidates import Draft, Drafter
from server.shared.protocol import Grammar, PrefillRequest, SamplingParams

DEFAULT_MAX_NGRAM = 4
DEFAULT_MIN_NGRAM = 2
# How far back to search: bounds the cost per round on long contexts.
DEFAULT_WINDOW = 4096


def lookup(
    committed: Sequence[int],
    k: int,
    *,
    max_ngram: int = DEFAULT_MAX_NGRAM,
    min_ngram: int = DEFAULT_MIN_NGRAM,
    window: int = DEFAULT_WINDOW,
) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    `committed` (of length max_ngram down to min_ngram); [] when none occurs."""
    if k <= 0:
        return []
    tokens = list(committed[-window:])
    n_tokens = len(tokens)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        suffix = tokens[n_tokens - n :]
        # Latest occurrence first; it must end before the suffix itself starts.
        for start in range(n_tokens - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


class NgramDrafter(Drafter):
    """A drafter with no model. With sampled drafts (rejection sampling) the
    proposal is a point mass on the looked-up token, sent as q = 1 for it: accepted with
    the target's own probability, so the output still follows the verifier exactly."""

    def __init__(
        self,
        n_vocab: int,
        *,
        sample_drafts: bool = False,
        max_ngram: int = DEFAULT_MAX_NGRAM,
        min_ngram: int = DEFAULT_MIN_NGRAM,
    ):
        self.n_vocab = n_vocab
        self.sample_drafts = sample_drafts
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def get_candidates(
        self, committed: Sequence[int], k: int, stop: Callable[[], bool] | None = None
    ) -> Draft:
        """`stop` does not apply: a lookup is instant."""
        tokens = lookup(committed, k, max_ngram=self.max_ngram, min_ngram=self.min_ngram)
        probs = [self._point_mass(t) for t in tokens] if self.sample_drafts else None
        return Draft(tokens, probs, lookup=True)

    def _point_mass(self, token: int) -> np.ndarray:
        q = np.zeros(self.n_vocab, dtype=np.float32)
        q[token] = 1.0
        return q


class ModelWithLookup(Drafter):
    """A lookup's drafts (prompt lookup, or the suffix drafter over the user's history)
    where the text so far has a match, the draft model's otherwise. The model warms and
    catches up (a round without a draft is its time to, whoever drafts next) and follows
    the verifier's rules; both learn from a finished generation. The model ranks the
    answers to its own drafts; a lookup's are not ranked (the model's ranking would be of
    a draft it did not make, and a lookup's next draft costs nothing to make when its
    answer comes)."""

    catches_up = True
    mixes_kinds = True

    def __init__(self, lookup: Drafter, model: Drafter):
        self.lookup = lookup
        self.model = model
        self.warms = model.warms

    def get_candidates(
        self, committed: Sequence[int], k: int, stop: Callable[[], bool] | None = None
    ) -> Draft:
        found = self.lookup.get_candidates(committed, k)
        if found.tokens:
            return found
        return self.model.get_candidates(committed, k, stop)

    def lookup_draft(self, committed: Sequence[int], k: int) -> Draft:
        """The lookup's draft alone: for a round the model would not draft."""
        return self.lookup.get_candidates(committed, k)

    def warm(self, prefill: PrefillRequest, stop: Callable[[], bool] | None = None) -> None:
        self.model.warm(prefill, stop)

    def catch_up(self, committed: Sequence[int], stop: Callable[[], bool] | None = None) -> bool:
        return self.model.catch_up(committed, stop)

    def follow(self, sampling: SamplingParams, grammar: Grammar | None, prompt_len: int) -> None:
        """The model's drafts follow the verifier's rules; the n-gram drafts copy the
        text, which followed them."""
        self.model.follow(sampling, grammar, prompt_len)

    def likely_answers(
        self, committed: Sequence[int], draft: Sequence[int], limit: int
    ) -> list[tuple[int, int]] | None:
        # The lookup's draft is the one it makes again from the same text (it is pure).
        if self.lookup.get_candidates(committed, len(draft)).tokens == list(draft):
            return None
        return self.model.likely_answers(committed, draft, limit)

    def answered(self, draft: Draft, verified: int, accepted_prefix_len: int) -> None:
        (self.lookup if draft.lookup else self.model).answered(draft, verified, accepted_prefix_len)

    def finish(self, text: Sequence[int]) -> None:
        self.lookup.finish(text)
        self.model.finish(text)
