"""Whether and how a draft model drafts for a verifier: with token ids as they are (the
same vocabulary, or a compatible one as llama.cpp judges it: server/shared/vocab.py), through
text (another tokenizer: drafter/drafters/translate.py), or not at all."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from drafter.errors import VerifierUnavailable, VocabularyMismatch
from server.shared.info import InfoResponse
from server.shared.protocol import PROTOCOL_VERSION
from server.shared.vocab import Incompatible, Relation, VocabFacts, relation

# How the drafter's ids reach the verifier: as they are, or through text.
DraftingMode = Relation | Literal["translated"]


def check_protocol(info: InfoResponse) -> None:
    if info.protocol_version != PROTOCOL_VERSION:
        raise VerifierUnavailable(
            f"the verifier speaks protocol v{info.protocol_version}; this drafter speaks "
            f"v{PROTOCOL_VERSION}"
        )


def check_vocabulary(
    info: InfoResponse,
    drafter: VocabFacts,
    *,
    drafter_name: str,
    drafter_path: Path,
    translate: bool | None = None,
) -> tuple[DraftingMode, str]:
    """How the drafter's ids reach the verifier: "same" or "compatible" (as they are),
    or "translated" (through text) where `translate` allows it (None: not offered here);
    with a sentence naming both models and why, when they are not the same. Otherwise
    VocabularyMismatch."""
    verifier = info.vocabulary()
    pair = (
        f"the drafter model '{drafter_name}' ({drafter_path.name}, {drafter.n_vocab} tokens, "
        f"vocab hash {drafter.hash[:12]}) and the verifier model '{info.model}' "
        f"({Path(info.model_path).name}, {verifier.n_vocab} tokens, vocab hash "
        f"{verifier.hash[:12]})"
    )
    try:
        if not verifier.type and verifier.hash != drafter.hash:
            raise Incompatible("the verifier is too old to compare vocabularies beyond equality")
        found = relation(verifier, drafter)
    except Incompatible as exc:
        if translate and verifier.type:
            return "translated", (
                f"drafting through text: {pair} have different vocabularies ({exc}); "
                "--no-translate refuses such a pair instead"
            )
        hint = ", or leave out --no-translate to draft through text" if translate is False else ""
        raise VocabularyMismatch(
            f"vocabulary mismatch: {pair} cannot draft with token ids: {exc}. Use a drafter "
            f"from the verifier's model family (see models/manifest.json){hint}."
        ) from exc
    if found == "compatible":
        return found, f"drafting with token ids: {pair} have compatible vocabularies"
    return found, ""
