"""The draft-length schedules."""

import pytest

from drafter.draft_length import AdaptiveLength, DoublingLength, FixedLength
from drafter.settings import parse_draft_n


def test_fixed_length_never_moves():
    length = FixedLength(4)
    length.update(4, 4)
    length.update(4, 0)
    assert length.next() == 4


def test_adaptive_grows_by_two_on_full_acceptance_and_shrinks_by_one_otherwise():
    length = AdaptiveLength(maximum=16, start=4)
    seen = []
    for accepted_all in (True, True, False, True, False, False, False, False, False):
        k = length.next()
        length.update(k, k if accepted_all else k - 1)
        seen.append(length.next())
    assert seen == [6, 8, 7, 9, 8, 7, 6, 5, 4]


def test_adaptive_stays_within_its_bounds():
    length = AdaptiveLength(maximum=5, start=4, minimum=1)
    for _ in range(5):
        length.update(length.next(), length.next())
    assert length.next() == 5
    for _ in range(10):
        length.update(length.next(), 0)
    assert length.next() == 1


def test_a_round_with_no_draft_teaches_nothing():
    length = AdaptiveLength(maximum=16, start=4)
    length.update(0, 0)
    assert length.next() == 4


def test_doubling_jumps_up_on_whole_drafts_and_down_to_what_was_accepted():
    length = DoublingLength(maximum=16, start=4)
    seen = []
    for drafted, accepted in ((4, 4), (8, 8), (16, 16), (16, 9), (10, 0), (1, 1), (0, 0), (2, 2)):
        assert length.next() >= drafted
        length.update(drafted, accepted)
        seen.append(length.next())
    assert seen == [8, 16, 16, 10, 1, 2, 2, 4]


def test_doubling_bounds():
    length = DoublingLength(maximum=6, start=10, minimum=2)
    assert length.next() == 6
    length.update(6, 0)
    assert length.next() == 2
    with pytest.raises(ValueError):
        DoublingLength(maximum=4, minimum=0)


def test_auto_means_the_schedule_that_suits_the_drafter():
    from drafter.runner import draft_length
    from drafter.settings import DrafterSettings
    from server.shared.protocol import InfoResponse

    info = InfoResponse.model_construct(max_draft=16)

    def length(**settings):
        return draft_length(DrafterSettings(**settings), info)

    assert isinstance(length(draft_n="auto"), AdaptiveLength)
    assert isinstance(length(draft_n="auto", drafter="model+ngram"), AdaptiveLength)
    assert isinstance(length(draft_n="auto", drafter="ngram"), DoublingLength)
    assert length(draft_n="auto", drafter="ngram").maximum == 16
    assert length(draft_n=3) == FixedLength(3)


def test_parse_draft_n():
    assert parse_draft_n("auto") == "auto"
    assert parse_draft_n(" AUTO ") == "auto"
    assert parse_draft_n("7") == 7
    for bad in ("-1", "many", "1.5", "257"):
        with pytest.raises(ValueError):
            parse_draft_n(bad)
