"""DraftSequence.warm_up (drafter/drafters/draft_sequence.py) on a stand-in context: the passes it
makes, and a cache left empty whether or not a pass failed."""

from __future__ import annotations

import numpy as np
import pytest

from drafter.drafters.draft_sequence import WARM_UP_PASSES, DraftSequence


class Context:
    """Decodes into nothing, recording each pass; the pass numbered `fail_at` raises."""

    def __init__(self, fail_at: int | None = None):
        self.passes: list[list[int]] = []
        self.removed: list[tuple[int, int]] = []
        self.fail_at = fail_at

    def decode(self, seq_id, tokens, start, alone=False):
        if len(self.passes) == self.fail_at:
            raise RuntimeError("decode failed")
        self.passes.append(list(tokens))
        return np.zeros(4, dtype=np.float32)

    def remove(self, seq_id, start):
        self.removed.append((seq_id, start))


def test_warm_up_reads_the_weights_in_then_times_passes_of_two_and_empties_the_cache():
    context = Context()
    sequence = DraftSequence(context, seq_id=0)
    assert sequence.warm_up(7) >= 0.0
    assert context.passes == [[7]] + [[7, 7]] * WARM_UP_PASSES
    assert sequence.cached == [] and context.removed[-1] == (0, -1)


@pytest.mark.parametrize("fail_at", [0, 2])
def test_a_warm_up_that_fails_leaves_the_cache_empty(fail_at):
    context = Context(fail_at)
    sequence = DraftSequence(context, seq_id=0)
    with pytest.raises(RuntimeError):
        sequence.warm_up(7)
    assert sequence.cached == [] and context.removed[-1] == (0, -1)
