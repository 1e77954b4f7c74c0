"""Prompt reuse: which cached prefix a new prompt starts from.

A session that ends (DELETE, expiry, the end of a /generate) leaves its KV sequence and
tokens behind as a cached prefix, until the sequence is needed or its TTL ends. A new
prompt of the same API key takes the cached prefix with which it shares the longest
common prefix (tokens compared one by one, never hashed), trimmed to that, and evaluates
only the rest. Prefixes are never shared across keys, nor across the cache scopes a
proxy names for its own clients (`cache_scope`): a shared cache leaks prompts through
timing and `cached_tokens`. Where prompts are evaluated in a tiled part and the rest
(prompt_cuts.py), a prompt keeps only the cells its own cold evaluation would write.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from server.shared.prefix import common_prefix_len
from server.verifier.kv.prompt_cuts import PromptCuts, Tiling, retile_plan, reusable


@dataclass(frozen=True)
class CachedPrefix:
    owner: str
    tokens: list[int]  # exactly what the sequence's KV cells hold, in position order
    cached_at: float = field(default_factory=time.monotonic)
    tiling: Tiling = ()  # which of its cells were written in tiled passes (prompt_cuts.py)
    scope: str = ""  # the cache scope of the session it was ("": the key's own)


class PrefixReuse:
    """The cached prefixes, by KV sequence id, least recently cached first, and which one
    a prompt reuses. `min_tokens` 0: none is kept or reused."""

    def __init__(self, min_tokens: int, cuts: PromptCuts | None = None):
        self.min_tokens = min_tokens
        self.cuts = cuts or PromptCuts(0)
        self._cached: OrderedDict[int, CachedPrefix] = OrderedDict()
        # Each prefix's plan, found once (a prefix is replaced, never changed, when its
        # cells change): idle moments come often, and finding one reads every token.
        self._plans: dict[int, tuple[CachedPrefix, tuple[int, Tiling] | None]] = {}

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._cached

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._cached))

    def items(self) -> list[tuple[int, CachedPrefix]]:
        return list(self._cached.items())

    def keeps(self, n_cached: int) -> bool:
        """Whether an ended session holding `n_cached` cells is worth keeping."""
        return bool(self.min_tokens) and n_cached >= self.min_tokens

    def keep(self, seq_id: int, prefix: CachedPrefix) -> None:
        self._cached[seq_id] = prefix

    def pop(self, seq_id: int) -> CachedPrefix:
        return self._cached.pop(seq_id)

    def relocate(self, seq_id: int, to: int) -> None:
        """The prefix at `seq_id` now lives at `to`, in the same place in the order."""
        self._cached = OrderedDict((to if s == seq_id else s, p) for s, p in self._cached.items())

    def to_retile(self) -> tuple[int, int, Tiling] | None:
        """A cached prefix whose cells are not what a prompt going on from it
        would write (the generated tokens of the session it was, outside a chat reply),
        most recently cached first: its seq id and `retile_plan`'s (start, tiling)."""
        cuts, plans = self.cuts, {}
        for seq_id, prefix in self._cached.items():
            known = self._plans.get(seq_id)
            if known is not None and known[0] is prefix:
                plans[seq_id] = known
            else:
                plan = retile_plan(
                    prefix.tokens, prefix.tiling, cuts.tile_rows, cuts.replies, cuts.pad
                )
                plans[seq_id] = prefix, plan
        self._plans = plans
        for seq_id in reversed(self._cached):
            plan = plans[seq_id][1]
            if plan is not None:
                return seq_id, *plan
        return None

    def older_than(self, ttl_s: float, now: float) -> list[int]:
        return [s for s, p in self._cached.items() if now - p.cached_at > ttl_s]

    def take(
        self, owner: str, prompt: Sequence[int], tiling: Tiling = (), scope: str = ""
    ) -> tuple[int, int] | None:
        """The seq id of `owner`'s prefix of cache `scope` to reuse for `prompt`, taken
        out of the cache, and how many of its tokens to keep (never the prompt's last
        token: that one is evaluated with the first round; only cells the prompt's own
        evaluation would write, tiled as `tiling` says); None when none keeps
        `min_tokens`."""
        if not self.min_tokens or len(prompt) < 2:
            return None
        best_seq, best_len = None, 0
        for seq_id, prefix in self._cached.items():
            if prefix.owner == owner and prefix.scope == scope:
                n = min(common_prefix_len(prefix.tokens, prompt), len(prompt) - 1)
                n = reusable(n, prefix.tiling, tiling, self.cuts.tile_rows)
                if n > best_len:
                    best_seq, best_len = seq_id, n
        if best_seq is None or best_len < self.min_tokens:
            return None
        del self._cached[best_seq]
        return best_seq, best_len
