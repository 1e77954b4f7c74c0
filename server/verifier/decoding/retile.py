"""Idle work: a cached prefix evaluated again the way a prompt going on from it would be.

A session's generated tokens were rows of rounds (passes below the tile). A chat's next
prompt holds them as a reply, below the tile too; but a prompt that goes on from them
without a reply opener (a completion continued) holds them in its last stretch, which its
cold evaluation tiles (prompt_cuts.py): reused as they are they would answer otherwise,
so that prompt would keep only the cells before them. Evaluated again while the verifier
has nothing else to do, they are kept (up to where what a next prompt has left to
evaluate fills a tiled pass). One piece at a time (two tiles at most), so
that a request that arrives meanwhile waits for one piece, never for a whole prefix:
between pieces the cached prefix holds exactly the cells evaluated so far, and the plan
(`Retiling`) goes on at the next idle moment, or is dropped if the prefix was taken,
moved or dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from server.shared.runtime import LlamaRuntime
from server.verifier.decoding.decoder import PassDecoder
from server.verifier.decoding.jobs import JobRows
from server.verifier.decoding.passes import PassShapes
from server.verifier.kv.prompt_cuts import PromptCuts, Tiling, clip
from server.verifier.kv.sessions import SessionTable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Retiling:
    """A cached prefix being evaluated again: its sequence, all the tokens it is to hold
    again, and which of them go in tiled passes."""

    seq_id: int
    tokens: list[int]
    tiling: Tiling


class Retiler:
    def __init__(self, cuts: PromptCuts):
        self.cuts = cuts
        self.plan: Retiling | None = None

    def step(
        self,
        sessions: SessionTable,
        runtime: LlamaRuntime,
        decoder: PassDecoder,
        shapes: PassShapes,
    ) -> int:
        """One piece of idle work; the tokens evaluated (0: nothing needed it). If a
        decode fails, the prefix keeps the cells done; if they cannot be trimmed, it is
        dropped."""
        plan = self._current(sessions) or self._begin(sessions, runtime)
        if plan is None:
            return 0
        cached = sessions.cached_prefixes[plan.seq_id]
        done = len(cached.tokens)
        n = self.cuts.piece(done, plan.tiling, len(plan.tokens), interleaved=True)
        rows = self.cuts.pass_rows(done, plan.tiling)
        piece = JobRows(plan.seq_id, done, plan.tokens[done : done + n], False, rows)
        try:
            decoder.decode([piece], shapes)
        except Exception:
            log.exception("could not evaluate a cached prefix again; keeping what is done")
            self.plan = None
            try:
                runtime.remove(plan.seq_id, done)
            except Exception:
                log.exception("could not trim it either; dropping it")
                sessions.drop_prefix(plan.seq_id)
            return 0
        done += n
        # In its place in the cache's order, its age unchanged.
        kept = replace(cached, tokens=plan.tokens[:done], tiling=clip(plan.tiling, done))
        sessions.prefix_reuse.keep(plan.seq_id, kept)
        if done == len(plan.tokens):
            self.plan = None
        return n

    def _current(self, sessions: SessionTable) -> Retiling | None:
        """The plan under way, if its prefix is still cached as the plan left it."""
        plan = self.plan
        cached = sessions.cached_prefixes.get(plan.seq_id) if plan else None
        if plan is None or cached is None:
            self.plan = None
            return None
        done = len(cached.tokens)
        if cached.tokens != plan.tokens[:done] or cached.tiling != clip(plan.tiling, done):
            self.plan = None
            return None
        return plan

    def _begin(self, sessions: SessionTable, runtime: LlamaRuntime) -> Retiling | None:
        """The next prefix to evaluate again, its cells from the plan's start removed."""
        found = sessions.prefix_reuse.to_retile()
        if found is None:
            return None
        seq_id, start, tiling = found
        cached = sessions.cached_prefixes[seq_id]
        try:
            runtime.remove(seq_id, start)
        except Exception:
            log.exception("could not trim a cached prefix to evaluate it again; dropping it")
            sessions.drop_prefix(seq_id)
            return None
        # Its cells [0, start) are what the plan's tiling says already.
        kept = replace(cached, tokens=cached.tokens[:start], tiling=clip(tiling, start))
        sessions.prefix_reuse.keep(seq_id, kept)
        self.plan = Retiling(seq_id, list(cached.tokens), tiling)
        return self.plan
