"""Whether a drafter's token ids mean the same to a verifier, as llama.cpp judges it
(`common_speculative_are_compatible` in common/speculative.cpp): the same vocabulary type,
the same BOS and EOS and their add-BOS/add-EOS flags, sizes within 128 of each other, and
the same text for every id both have from id 5 on. Pure: both sides describe their
vocabulary with `describe`, the verifier publishes it in /info, the drafter compares."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal, NamedTuple

if TYPE_CHECKING:
    from server.shared.runtime import LlamaRuntime

# llama.cpp's SPEC_VOCAB_CHECK_START_TOKEN_ID: the first ids are special tokens a family
# may spell differently (<s> and <|endoftext|> for one role); BOS and EOS are compared by
# id instead. We skip the same ids, so that we accept exactly the pairs llama.cpp does.
CHECK_START_ID = 5
# llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE: families pad to a multiple (Qwen2.5 to
# 151,936 and 152,064), and the padding is never a real token.
MAX_SIZE_DIFFERENCE = 128
# llama_vocab_type's values.
VOCAB_TYPES = {0: "none", 1: "spm", 2: "bpe", 3: "wpm", 4: "ugm", 5: "rwkv", 6: "plamo2"}

Relation = Literal["same", "compatible"]


class VocabFacts(NamedTuple):
    type: str
    n_vocab: int
    bos_id: int
    eos_id: int
    add_bos: bool
    add_eos: bool
    hash: str  # every token's text, in id order: equal means the same vocabulary
    # The hash of the texts of ids [CHECK_START_ID, end), for every end within
    # MAX_SIZE_DIFFERENCE of n_vocab: the range any compatible vocabulary shares with
    # this one has its hash here, so no one needs the whole vocabulary to compare.
    text_hashes: dict[int, str]


class Incompatible(ValueError):
    """Why two vocabularies' ids do not mean the same (a sentence naming the rule)."""


def vocab_fingerprint(pieces: Iterable[bytes]) -> str:
    """Hash of a vocabulary: every token's raw text, in id order."""
    digest = hashlib.sha256()
    for token_id, piece in enumerate(pieces):
        digest.update(token_id.to_bytes(4, "little"))
        digest.update(len(piece).to_bytes(4, "little"))
        digest.update(piece)
    return digest.hexdigest()


def text_hashes(pieces: list[bytes]) -> dict[int, str]:
    n_vocab = len(pieces)
    first_end = max(CHECK_START_ID, n_vocab - MAX_SIZE_DIFFERENCE)
    digest = hashlib.sha256()
    hashes: dict[int, str] = {}
    for token_id in range(CHECK_START_ID, n_vocab + 1):
        if token_id >= first_end:
            hashes[token_id] = digest.hexdigest()[:32]
        if token_id < n_vocab:
            piece = pieces[token_id]
            digest.update(len(piece).to_bytes(4, "little"))
            digest.update(piece)
    return hashes


def describe(runtime: LlamaRuntime) -> VocabFacts:
    """The facts of a LlamaRuntime's vocabulary (duck-typed: this module stays pure)."""
    pieces = list(runtime.vocab_pieces())
    return VocabFacts(
        type=runtime.vocab_type,
        n_vocab=runtime.n_vocab,
        bos_id=runtime.bos_id,
        eos_id=runtime.eos_id,
        add_bos=runtime.add_bos,
        add_eos=runtime.add_eos,
        hash=vocab_fingerprint(pieces),
        text_hashes=text_hashes(pieces),
    )


def relation(verifier: VocabFacts, drafter: VocabFacts) -> Relation:
    """ "same", "compatible", or Incompatible with the first rule the pair breaks."""
    if verifier.hash == drafter.hash and verifier.n_vocab == drafter.n_vocab:
        return "same"
    if verifier.type != drafter.type:
        raise Incompatible(f"vocabulary types differ ({verifier.type} and {drafter.type})")
    for what in ("bos_id", "eos_id", "add_bos", "add_eos"):
        if getattr(verifier, what) != getattr(drafter, what):
            raise Incompatible(
                f"{what} differs ({getattr(verifier, what)} and {getattr(drafter, what)})"
            )
    difference = abs(verifier.n_vocab - drafter.n_vocab)
    if difference > MAX_SIZE_DIFFERENCE:
        raise Incompatible(
            f"sizes differ by {difference} tokens ({verifier.n_vocab} and "
            f"{drafter.n_vocab}; at most {MAX_SIZE_DIFFERENCE})"
        )
    shared = min(verifier.n_vocab, drafter.n_vocab)
    ours, theirs = verifier.text_hashes.get(shared), drafter.text_hashes.get(shared)
    if ours is None or theirs is None or ours != theirs:
        raise Incompatible(
            f"the token texts of ids {CHECK_START_ID} to {shared - 1} differ (the ids "
            "both vocabularies have)"
        )
    return "compatible"
