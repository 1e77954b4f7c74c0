"""Where a text repeats itself: the one search the verifier's copies inside its chunks
(server/verifier/decoding/copy_draft.py) and a drafter that leaves those repeats to them
(drafter/drafters/history_lookup.py) both make, so that they agree on which repeats those are."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

TOKEN_BYTES = array("i").itemsize


def copy_source(tokens: Sequence[int], ngram: int) -> int | None:
    """Where what followed the latest earlier occurrence of the last `ngram` tokens of
    `tokens` starts; None where they occur nowhere earlier."""
    n = len(tokens)
    if ngram <= 0 or n <= ngram:
        return None
    # Searched as bytes, in C: every step of a chunk searches the session's whole text.
    # A match must start on a token's boundary; one that does not is skipped.
    text = array("i", tokens).tobytes()
    pattern = text[(n - ngram) * TOKEN_BYTES :]
    end = (n - 1) * TOKEN_BYTES  # an occurrence ends before the pattern itself does
    while (at := text.rfind(pattern, 0, end)) >= 0:
        if at % TOKEN_BYTES == 0:
            return at // TOKEN_BYTES + ngram
        end = at + len(pattern) - 1
    return None
