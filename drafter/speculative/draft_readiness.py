"""Whether the draft model is ready for a drafted round, and when it catches up.

The loop would rather send a round without a draft than make a drafted round wait for the
draft model (still warming, or behind the tokens rounds without a draft committed); the
model catches up while such rounds are out, as far as it gets before their answers come.
"""

from __future__ import annotations

from drafter.speculative.candidates import Draft, DraftLength
from drafter.speculative.warming import Warming


def drafts_soon(length: DraftLength) -> bool:
    """Whether the next round, or the one after it, may carry a draft."""
    return length.next() > 0 or length.drafts_soon()


def holds_back(length: DraftLength, k: int, behind: bool, warming: Warming) -> bool:
    """Whether a round of `k` drafts whose draft is still to be made goes without one:
    the draft model is not ready (`behind`, or still warming) and the length adapts to
    rounds without a draft (`adaptive`; a fixed length waits)."""
    return k > 0 and length.adaptive and (behind or warming.running())


def catches_up(length: DraftLength, behind: bool, draft: Draft, left: int, chunk: int) -> bool:
    """Whether the draft model catches up while this round is out: a round without the
    model's draft (none, or a lookup's: the model is idle) before a drafted one, or while
    the model is `behind`, unless its `chunk` may be all of the `left` tokens still
    wanted (no drafted round follows)."""
    soon = behind or length.drafts_soon()
    modelled = bool(draft.tokens) and not draft.lookup
    return not modelled and soon and left > chunk
