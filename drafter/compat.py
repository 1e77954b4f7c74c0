"""Whether a draft model may draft for a verifier: same vocabulary, or nothing at all."""

from __future__ import annotations

from pathlib import Path

from drafter.errors import VerifierUnavailable, VocabularyMismatch
from server.protocol import PROTOCOL_VERSION, InfoResponse


def check_protocol(info: InfoResponse) -> None:
    if info.protocol_version != PROTOCOL_VERSION:
        raise VerifierUnavailable(
            f"the verifier speaks protocol v{info.protocol_version}; this drafter speaks "
            f"v{PROTOCOL_VERSION}"
        )


def check_vocabulary(
    info: InfoResponse, *, drafter_name: str, drafter_path: Path, vocab_hash: str, n_vocab: int
) -> None:
    """Token ids mean the same on both sides only if the vocabularies are identical."""
    if vocab_hash == info.vocab_hash and n_vocab == info.n_vocab:
        return
    raise VocabularyMismatch(
        "vocabulary mismatch: the drafter model "
        f"'{drafter_name}' ({drafter_path.name}, {n_vocab} tokens, vocab hash "
        f"{vocab_hash[:12]}) cannot draft for the verifier model '{info.model}' "
        f"({Path(info.model_path).name}, {info.n_vocab} tokens, vocab hash "
        f"{info.vocab_hash[:12]}). Use a drafter from the verifier's model family "
        "(see models/manifest.json)."
    )
