"""One sequence of a draft context and what its KV cache holds.

The cache follows the tokens asked for by longest common prefix: only what differs is
dropped, and only new tokens are evaluated. The logits after each of the last positions
are kept, so a cache that ran ahead (a draft chain) is cut back without a decode.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np

from drafter.drafters.draft_context import DraftContext
from server.shared.prefix import common_prefix_len

# Logits rows kept for cutting the cache back without a decode: two rounds of drafts.
MAX_KEPT_LOGITS = 40
# Timed passes of the warm-up: their median is the draft model's time.
WARM_UP_PASSES = 3


class DraftSequence:
    def __init__(self, context: DraftContext, seq_id: int):
        self.context = context
        self.seq_id = seq_id
        self.cached: list[int] = []  # tokens whose KV entries are in the cache
        self._last_logits: np.ndarray | None = None
        # Logits after the cached token at each position, for the positions of the last
        # chain: so a cache that runs ahead of what is committed is cut back for free.
        self._logits_at: dict[int, np.ndarray] = {}
        self.decoded_tokens = 0

    def logits_at(self, position: int) -> np.ndarray | None:
        """The logits after the token at `position`, if kept."""
        return self._logits_at.get(position)

    def sync(self, tokens: Sequence[int], alone: bool = False) -> np.ndarray:
        """Make the cache hold exactly `tokens`; return the logits after the last one.
        `alone`: decode without batch-mates (see DraftContext.decode)."""
        common = common_prefix_len(self.cached, tokens)
        if common == len(tokens):
            kept = self._logits_at.get(common - 1)
            if common == len(self.cached) and self._last_logits is not None:
                return self._last_logits
            if kept is not None:
                self._truncate(common)
                self._last_logits = kept
                return kept
            common -= 1  # the last token's logits are needed: evaluate it again
        self._truncate(common)
        return self.evaluate(tokens[common:], alone)

    def evaluate(self, tokens: Sequence[int], alone: bool = False) -> np.ndarray:
        """Append `tokens` to the cache; the logits after the last one."""
        start = len(self.cached)
        # On failure the context has dropped the cells from `start`: nothing to undo here.
        logits = self.context.decode(self.seq_id, tokens, start, alone=alone)
        self.cached.extend(tokens)
        self.decoded_tokens += len(tokens)
        self._last_logits = logits
        # Only the chain's neighbourhood is worth keeping (a row is n_vocab floats).
        last = len(self.cached) - 1
        self._logits_at = {p: v for p, v in self._logits_at.items() if p > last - MAX_KEPT_LOGITS}
        self._logits_at[last] = logits
        return logits

    def warm_up(self, token: int, alone: bool = False) -> float:
        """One pass of one token (the weights read in), then passes of two, timed: what a
        draft waits for after an answer that took its draft, whose two new tokens the
        model evaluates first. The median of their seconds (one pass alone may have
        waited on anything else the machine ran); the cache is left empty, whatever
        failed."""
        try:
            self.evaluate([token], alone)
            seconds = []
            for _ in range(WARM_UP_PASSES):
                began = time.perf_counter()
                self.evaluate([token, token], alone)
                seconds.append(time.perf_counter() - began)
            return statistics.median(seconds)
        finally:
            self.reset()

    def reset(self) -> None:
        """Forget the cache."""
        self.context.remove(self.seq_id, -1)
        self.cached = []
        self._last_logits = None
        self._logits_at = {}

    def _truncate(self, length: int) -> None:
        self.context.remove(self.seq_id, length)
        del self.cached[length:]
        self._logits_at = {p: v for p, v in self._logits_at.items() if p < length}
