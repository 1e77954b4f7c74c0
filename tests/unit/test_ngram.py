"""Prompt lookup: which tokens it proposes, and the q it sends when drafts are sampled."""

import numpy as np

from drafter.drafters.ngram import ModelWithLookup, NgramDrafter, lookup
from drafter.speculative.candidates import Drafter


def test_the_tokens_after_the_earlier_occurrence_of_the_suffix():
    text = [1, 2, 3, 4, 5, 6, 9, 9, 2, 3]
    assert lookup(text, 3) == [4, 5, 6]


def test_the_latest_earlier_occurrence_wins():
    text = [7, 8, 1, 7, 8, 2, 0, 7, 8]
    assert lookup(text, 1) == [2]


def test_longer_ngrams_are_tried_first():
    # "3 4" occurs twice; only the earlier one is preceded by 2 as the suffix is.
    text = [2, 3, 4, 10, 11, 9, 3, 4, 20, 2, 3, 4]
    assert lookup(text, 2, max_ngram=3) == [10, 11]
    assert lookup(text, 2, max_ngram=2) == [20, 2]


def test_no_match_no_draft_and_k_caps_the_draft():
    assert lookup([1, 2, 3, 4], 4) == []
    assert lookup([5, 6, 7, 5, 6], 1) == [7]
    assert lookup([5, 6, 7, 5, 6], 0) == []
    # A single repeated token is below the default minimum n-gram of 2.
    assert lookup([1, 9, 2, 9], 2) == []
    assert lookup([1, 9, 2, 9], 2, min_ngram=1) == [2, 9]


def test_the_draft_never_runs_past_the_text():
    assert lookup([1, 2, 1, 2], 5) == [1, 2]


def test_sampled_drafts_send_a_point_mass():
    drafter = NgramDrafter(50, sample_drafts=True)
    draft = drafter.get_candidates([4, 5, 6, 4, 5], 2)
    assert draft.tokens == [6, 4]
    for token, q in zip(draft.tokens, draft.probs, strict=True):
        assert q.shape == (50,) and q[token] == 1.0 and np.count_nonzero(q) == 1
    assert NgramDrafter(50).get_candidates([4, 5, 6, 4, 5], 2).probs is None


class CountingModel(Drafter):
    def __init__(self):
        self.calls = 0

    def get_candidates(self, committed, k, stop=None):
        self.calls += 1
        return NgramDrafter(10).get_candidates([], 0)._replace(tokens=[3] * k)


def test_model_with_ngram_asks_the_model_only_without_a_match():
    model = CountingModel()
    both = ModelWithLookup(NgramDrafter(10), model)
    assert both.get_candidates([1, 2, 5, 1, 2], 2).tokens == [5, 1]
    assert model.calls == 0
    assert both.get_candidates([1, 2, 3, 4], 2).tokens == [3, 3]
    assert model.calls == 1
