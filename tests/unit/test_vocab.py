"""llama.cpp's vocabulary compatibility rules (server/shared/vocab.py), on made-up vocabularies."""

from __future__ import annotations

import pytest

from server.shared.vocab import (
    CHECK_START_ID,
    MAX_SIZE_DIFFERENCE,
    Incompatible,
    VocabFacts,
    relation,
    text_hashes,
    vocab_fingerprint,
)

BASE = [f"t{i}".encode() for i in range(1000)]


def facts(pieces: list[bytes], **changes) -> VocabFacts:
    described = VocabFacts(
        type="bpe",
        n_vocab=len(pieces),
        bos_id=1,
        eos_id=2,
        add_bos=True,
        add_eos=False,
        hash=vocab_fingerprint(pieces),
        text_hashes=text_hashes(pieces),
    )
    return described._replace(**changes)


def padded(pieces: list[bytes], n: int) -> list[bytes]:
    return pieces + [f"[PAD{len(pieces) + i}]".encode() for i in range(n)]


def test_the_same_vocabulary_is_same():
    assert relation(facts(BASE), facts(list(BASE))) == "same"


@pytest.mark.parametrize("pad", [1, 64, MAX_SIZE_DIFFERENCE])
def test_padding_either_way_within_the_limit_is_compatible(pad):
    assert relation(facts(padded(BASE, pad)), facts(BASE)) == "compatible"
    assert relation(facts(BASE), facts(padded(BASE, pad))) == "compatible"


def test_padding_beyond_the_limit_is_not():
    with pytest.raises(Incompatible, match="sizes differ by 129"):
        relation(facts(padded(BASE, MAX_SIZE_DIFFERENCE + 1)), facts(BASE))


def test_one_ordinary_token_spelled_otherwise_is_not():
    other = list(BASE)
    other[500] = b"something else"
    with pytest.raises(Incompatible, match="token texts of ids 5 to 999 differ"):
        relation(facts(BASE), facts(other))


def test_the_first_ids_are_not_compared_as_llama_cpp_skips_them():
    other = list(BASE)
    other[CHECK_START_ID - 1] = b"<|endoftext|>"
    assert relation(facts(BASE), facts(other)) == "compatible"


@pytest.mark.parametrize(
    ("field", "value"),
    [("type", "spm"), ("bos_id", 0), ("eos_id", 3), ("add_bos", False), ("add_eos", True)],
)
def test_special_tokens_and_their_flags_must_agree(field, value):
    with pytest.raises(Incompatible, match=field if field != "type" else "types differ"):
        relation(facts(BASE), facts(padded(BASE, 8), **{field: value}))


def test_a_padded_vocabulary_publishes_the_hash_of_every_range_a_partner_can_share():
    hashes = text_hashes(padded(BASE, 200))
    assert min(hashes) == 1200 - MAX_SIZE_DIFFERENCE and max(hashes) == 1200
    # The range [5, 1000) of the padded vocabulary is the whole checked range of BASE.
    assert text_hashes(padded(BASE, 100))[1000] == text_hashes(BASE)[1000]
