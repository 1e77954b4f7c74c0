"""The suffix drafter (drafter/drafters/suffix.py) against a brute-force search of every position
of every text: the same longest match, the same occurrences voting, the same chain; its
history bounded in tokens, oldest texts evicted first; one user's history never drafts
for another's."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drafter.drafters.suffix import SuffixDrafter, SuffixHistory, SuffixRules
from drafter.errors import DrafterError
from drafter.runner import user_history
from drafter.settings import DrafterSettings

TOKENS = st.lists(st.integers(0, 3), max_size=40)  # a small alphabet: many matches


def match_length(text: Sequence[int], end: int, context: Sequence[int], rules: SuffixRules) -> int:
    """How many tokens before `end` in `text` equal the last ones of `context`, at most
    `rules.max_match`."""
    length = 0
    while (
        length < rules.max_match
        and length < end
        and length < len(context)
        and text[end - length - 1] == context[len(context) - length - 1]
    ):
        length += 1
    return length


def brute_force(
    context: Sequence[int], history: Sequence[Sequence[int]], k: int, rules: SuffixRules
) -> list[int]:
    """Every position of the live text (the context, followed by something), then of
    each text newest first, latest position first; the longest match wins."""
    texts = [list(context), *reversed([list(t) for t in history])]
    occurrences = []
    for text in texts:
        for end in range(len(text) - 1, rules.min_match - 1, -1):
            length = match_length(text, end, context, rules)
            if length >= rules.min_match:
                occurrences.append((text, end, length))
    if k <= 0 or not occurrences:
        return []
    best = max(length for _, _, length in occurrences)
    found = [(t, e) for t, e, length in occurrences if length == best]
    draft, score = [], 1.0
    while len(draft) < min(k, max(1, int(rules.match_factor * best))):
        step = len(draft)
        nexts = [t[e + step] for t, e in found if e + step < len(t)]
        if not nexts:
            break
        token = max(dict.fromkeys(nexts), key=nexts.count)  # first seen wins a tie
        score *= nexts.count(token) / len(nexts)
        if score < rules.min_score:
            break
        draft.append(token)
        found = [(t, e) for t, e in found if e + step < len(t) and t[e + step] == token]
    return draft


@settings(max_examples=400, deadline=None)
@given(
    history=st.lists(TOKENS, max_size=4),
    context=TOKENS,
    k=st.integers(0, 12),
    min_match=st.integers(1, 4),
    max_match=st.integers(4, 8),
    min_score=st.sampled_from([0.0, 0.3, 0.6]),
)
def test_drafts_equal_a_brute_force_search(history, context, k, min_match, max_match, min_score):
    rules = SuffixRules(min_match=min_match, max_match=max_match, min_score=min_score)
    shelf = SuffixHistory(10_000, min_match)
    for text in history:
        shelf.add(text)
    drafter = SuffixDrafter(8, shelf, rules=rules)
    assert drafter.get_candidates(context, k).tokens == brute_force(context, history, k, rules)


@settings(max_examples=100, deadline=None)
@given(context=st.lists(TOKENS, min_size=1, max_size=5), k=st.integers(1, 8))
def test_a_growing_generation_drafts_as_one_seen_whole(context, k):
    """Rounds extend the live text's index; a fresh drafter indexes it at once."""
    growing = SuffixDrafter(8)
    so_far: list[int] = []
    for part in context:
        so_far += part
        assert (
            growing.get_candidates(so_far, k).tokens
            == SuffixDrafter(8).get_candidates(so_far, k).tokens
        )


def test_the_history_is_bounded_and_evicts_its_oldest_texts_whole():
    shelf = SuffixHistory(max_tokens=10, min_match=2)
    shelf.add([1, 2, 3, 4])
    shelf.add([5, 6, 7, 8])
    shelf.add([9, 9, 9, 9])  # 12 > 10: the oldest text goes
    assert shelf.n_tokens == 8
    assert list(shelf.index.texts.values()) == [[5, 6, 7, 8], [9, 9, 9, 9]]
    shelf.add(list(range(20, 40)))  # longer than the bound: its last 10 tokens
    assert list(shelf.index.texts.values()) == [list(range(30, 40))]
    drafter = SuffixDrafter(64, shelf, rules=SuffixRules(min_match=2))
    assert drafter.get_candidates([1, 2], 3).tokens == []  # evicted: drafts nothing
    assert drafter.get_candidates([31, 32], 3).tokens == [33, 34, 35]
    for _ in range(50):  # many evictions: the index is rebuilt, never wrong
        shelf.add([7, 7, 1, 2, 3])
    assert shelf.n_tokens <= 10
    assert drafter.get_candidates([9, 1, 2], 2).tokens == [3]


def test_a_generation_joins_its_users_history_and_no_other_users():
    alice, bob = SuffixHistory(), SuffixHistory()
    secret = [11, 12, 13, 14, 15, 16, 17, 18]
    alices = SuffixDrafter(64, alice)
    alices.get_candidates(secret, 4)
    alices.finish(secret)  # the generation ended: its text is alice's history
    assert SuffixDrafter(64, alice).get_candidates([1, 11, 12, 13], 4).tokens == [14, 15, 16, 17]
    assert SuffixDrafter(64, bob).get_candidates([1, 11, 12, 13], 4).tokens == []
    assert bob.n_tokens == 0


def test_a_history_file_is_read_at_start_and_appended(tmp_path):
    path = tmp_path / "history.jsonl"
    first = SuffixHistory(path=path)
    first.add([1, 2, 3, 4, 5])
    again = SuffixHistory(path=path)
    assert list(again.index.texts.values()) == [[1, 2, 3, 4, 5]]
    assert SuffixDrafter(8, again).get_candidates([9, 1, 2, 3], 2).tokens == [4, 5]


def test_a_damaged_history_file_loses_only_its_damaged_lines(tmp_path):
    path = tmp_path / "history.jsonl"
    path.write_text('[1, 2, 3, 4]\n{"not": "tokens"}\n[5, "x"]\n[6, 7, 8, 9')  # cut short
    shelf = SuffixHistory(path=path)
    assert list(shelf.index.texts.values()) == [[1, 2, 3, 4]]
    shelf.add([10, 11, 12])
    assert list(SuffixHistory(path=path).index.texts.values()) == [[1, 2, 3, 4], [10, 11, 12]]


def test_a_changed_generation_is_indexed_anew():
    drafter = SuffixDrafter(64)
    assert drafter.get_candidates([1, 2, 3, 9, 1, 2, 3], 1).tokens == [9]
    # Not a continuation of what it held (another generation's text): rebuilt, not extended.
    assert drafter.get_candidates([5, 2, 3, 8, 5, 2, 3], 1).tokens == [8]
    assert drafter.get_candidates([1, 2, 3, 7, 1, 2, 3], 1).tokens == [7]


def test_a_history_file_that_cannot_be_used_is_a_clear_error_at_start(tmp_path):
    settings = DrafterSettings(drafter="suffix", history_file=tmp_path)  # a folder
    with pytest.raises(DrafterError, match="--history-file"):
        user_history(settings)
    assert user_history(DrafterSettings(drafter="ngram")) is None
