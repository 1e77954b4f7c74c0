import pytest

from server.shared.acceptance import accept_greedy

EOS = 2


def is_eog(token: int) -> bool:
    return token == EOS


def test_all_drafts_accepted_gets_bonus_token():
    verdict = accept_greedy([10, 11, 12], [10, 11, 12, 13], is_eog)
    assert verdict.accepted_prefix_len == 3
    assert verdict.tokens == [10, 11, 12, 13]
    assert not verdict.eos


def test_first_mismatch_is_replaced_by_recovered_token():
    verdict = accept_greedy([10, 99, 12], [10, 11, 12, 13], is_eog)
    assert verdict.accepted_prefix_len == 1
    assert verdict.tokens == [10, 11]


def test_matches_after_a_mismatch_do_not_count():
    verdict = accept_greedy([99, 11, 12], [10, 11, 12, 13], is_eog)
    assert verdict.accepted_prefix_len == 0
    assert verdict.tokens == [10]


def test_empty_draft_is_one_plain_step():
    verdict = accept_greedy([], [42], is_eog)
    assert verdict.accepted_prefix_len == 0
    assert verdict.tokens == [42]


def test_accepted_eos_draft_ends_the_round_with_nothing_after_it():
    verdict = accept_greedy([10, EOS, 12, 13], [10, EOS, 12, 13, 14], is_eog)
    assert verdict.tokens == [10, EOS]
    assert verdict.accepted_prefix_len == 1  # the EOS is committed as the target's token
    assert verdict.eos


def test_eos_as_recovered_token():
    verdict = accept_greedy([10, 11], [10, EOS, 7], is_eog)
    assert verdict.tokens == [10, EOS]
    assert verdict.eos


def test_eos_as_bonus_token():
    verdict = accept_greedy([10, 11], [10, 11, EOS], is_eog)
    assert verdict.tokens == [10, 11, EOS]
    assert verdict.accepted_prefix_len == 2
    assert verdict.eos


def test_rejected_eos_draft_does_not_end_generation():
    verdict = accept_greedy([EOS], [5, 6], is_eog)
    assert verdict.tokens == [5]
    assert not verdict.eos


def test_target_length_must_be_draft_plus_one():
    with pytest.raises(ValueError):
        accept_greedy([1, 2], [1, 2], is_eog)
