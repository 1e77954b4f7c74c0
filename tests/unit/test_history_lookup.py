"""`--drafter model+history` (drafter/drafters/history_lookup.py): the suffix drafter over the
user's
history alone, where the session's own text has no repeat the verifier copies, on a long
match; checked against a brute-force search, and one user's history never drafts for
another's."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from drafter.drafters.history_lookup import HistoryLookup
from drafter.drafters.ngram import ModelWithLookup
from drafter.drafters.suffix import SuffixHistory, SuffixRules, suffix_chain
from drafter.runner import candidate_generator, draft_length, user_history
from drafter.settings import DrafterSettings
from server.shared.info import InfoResponse
from tests.unit.test_suffix import TOKENS, match_length


def repeats(context: Sequence[int], n: int) -> bool:
    """Whether the last `n` tokens of `context` occurred earlier, something after them."""
    tail = list(context[-n:])
    return len(context) > n and any(
        list(context[end - n : end]) == tail for end in range(n, len(context))
    )


def longest_history_match(
    context: Sequence[int], history: Sequence[Sequence[int]], rules: SuffixRules
) -> int:
    best = 0
    for text in history:
        for end in range(rules.min_match, len(text)):  # something follows
            length = match_length(text, end, context, rules)
            if length >= rules.min_match:
                best = max(best, length)
    return best


@settings(max_examples=300, deadline=None)
@given(
    history=st.lists(TOKENS, max_size=4),
    context=TOKENS,
    k=st.integers(1, 12),
    copy_ngram=st.integers(0, 6),
    min_match=st.integers(3, 6),
)
def test_drafts_the_history_alone_where_the_verifier_does_not_copy(
    history, context, k, copy_ngram, min_match
):
    shelf = SuffixHistory()
    for text in history:
        shelf.add(text)
    drafter = HistoryLookup(64, shelf, copy_ngram=copy_ngram, min_match=min_match)
    draft = drafter.get_candidates(context, k)
    rules = SuffixRules()
    copied = copy_ngram > 0 and repeats(context, copy_ngram)
    match = longest_history_match(context, history, rules)
    if copied or match < min_match:
        assert draft.tokens == []
    else:
        assert draft.match == match
        # The chain the suffix drafter makes from the history alone.
        assert draft.tokens == suffix_chain(context, [shelf.index.occurrences], k, rules)
    assert draft.lookup


def test_a_request_asked_again_is_drafted_from_the_first_answer_and_only_for_its_user():
    question = list(range(100, 114))  # 14 tokens: a match of 12 and more
    answer = list(range(200, 220))
    alice, bob = SuffixHistory(), SuffixHistory()
    first = HistoryLookup(1000, alice, copy_ngram=12, sized=True)
    assert first.get_candidates(question, 8).tokens == []  # nothing in the history yet
    first.finish([*question, *answer])
    again = HistoryLookup(1000, alice, copy_ngram=12, sized=True)
    draft = again.get_candidates([7, *question], 8)
    assert draft.tokens == answer[:8] and draft.match == len(question)
    assert draft.accept is not None  # the band's estimate, for the verifier to size it
    assert HistoryLookup(1000, bob, copy_ngram=12).get_candidates([7, *question], 8).tokens == []
    # A short match is no draft: a chance repeat of a few tokens is seldom followed.
    assert again.get_candidates([7, *question[-5:]], 8).tokens == []


def test_the_sessions_own_repeat_is_left_to_the_verifiers_copies():
    text = list(range(100, 130))
    shelf = SuffixHistory()
    shelf.add(text)
    drafter = HistoryLookup(1000, shelf, copy_ngram=12)
    assert drafter.get_candidates(text[:20], 4).tokens == text[20:24]
    # The session's text now repeats its own last 12 tokens: the verifier copies them.
    session = [*text[:20], 1, *text[8:20]]
    assert drafter.get_candidates(session, 4).tokens == []
    # A verifier that never copies (chunk_copy_ngram 0): the history drafts there too.
    never = HistoryLookup(1000, shelf, copy_ngram=0)
    assert never.get_candidates(session, 4).tokens == text[20:24]
    # The session's own text alone never drafts: that is the verifier's to copy.
    alone = HistoryLookup(1000, SuffixHistory(), copy_ngram=0)
    assert alone.get_candidates(session, 4).tokens == []


def test_model_plus_history_wires_the_verifiers_copy_ngram_and_the_users_history():
    settings = DrafterSettings(drafter="model+history", draft_n="auto")
    history = user_history(settings)
    assert isinstance(history, SuffixHistory)
    model = SimpleNamespace(target_n_vocab=64, warms=True)
    options = settings.request_options()
    drafter = candidate_generator(
        model, settings, options, history=history, sized=True, copy_ngram=12
    )
    assert isinstance(drafter, ModelWithLookup) and isinstance(drafter.lookup, HistoryLookup)
    assert drafter.lookup.copy_ngram == 12 and drafter.lookup.history is history
    assert drafter.lookup.sized
    # Chunks paced as the model's alone are: the session's repeats are the verifier's.
    info = InfoResponse.model_construct(max_draft=16, max_chunk_tokens=64)
    assert not draft_length(settings, options, info, watched=False).watched
    suffix = DrafterSettings(drafter="model+suffix")
    assert draft_length(suffix, suffix.request_options(), info, watched=False).watched


def test_a_seeded_request_drafts_nothing_from_what_ran_before():
    """The same seed gives the same text: its drafts may not depend on the history (nor on
    the verifier's measured times, which size a lookup)."""
    history = SuffixHistory()
    history.add(list(range(100, 140)))
    model = SimpleNamespace(target_n_vocab=1000, warms=True)
    for kind in ("model+history", "model+suffix", "suffix"):
        seeded = DrafterSettings(drafter=kind, temperature=0.8, seed=11)
        options = seeded.request_options()
        drafter = candidate_generator(
            model, seeded, options, history=history, sized=True, copy_ngram=12
        )
        lookup = drafter.lookup if isinstance(drafter, ModelWithLookup) else drafter
        assert lookup.history is not history and lookup.history.n_tokens == 0, kind
        assert not lookup.sized, kind
        assert lookup.get_candidates(list(range(100, 120)), 4).tokens == [], kind
    unseeded = DrafterSettings(drafter="model+history", temperature=0.8)
    options = unseeded.request_options()
    drafter = candidate_generator(
        model, unseeded, options, history=history, sized=True, copy_ngram=12
    )
    assert drafter.lookup.get_candidates(list(range(100, 120)), 4).tokens == [120, 121, 122, 123]
