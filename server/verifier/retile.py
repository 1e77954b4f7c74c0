"""Idle work: a cached prefix evaluated again the way a prompt repeating it would be.

A session's generated tokens were rows of rounds (passes below the tile), but the same
client's next prompt holds them as prompt tokens, which its cold evaluation tiles
(prompt_cuts.py): reused as they are they would answer otherwise, so that prompt would
keep only the cells before them. Evaluated again while the verifier has nothing else to
do, they are kept whole.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from server.shared.runtime import LlamaRuntime
from server.verifier.decoder import PassDecoder
from server.verifier.jobs import JobRows
from server.verifier.passes import PassShapes
from server.verifier.prompt_cuts import PromptCuts
from server.verifier.sessions import SessionTable

log = logging.getLogger(__name__)


def retile(
    sessions: SessionTable,
    runtime: LlamaRuntime,
    decoder: PassDecoder,
    shapes: PassShapes,
    cuts: PromptCuts,
) -> int:
    """One cached prefix, the most recently cached that needs it, evaluated again from
    `retile_plan`'s start; the tokens evaluated (0: none needed it). If a decode fails,
    the prefix keeps the cells done; if they cannot be trimmed, it is dropped."""
    found = sessions.prefix_reuse.to_retile()
    if found is None:
        return 0
    seq_id, start, tiled_to = found
    cached = sessions.cached_prefixes[seq_id]
    n_cells, done = len(cached.tokens), start
    try:
        runtime.remove(seq_id, start)
        while done < n_cells:
            n = cuts.piece(done, tiled_to, n_cells)
            decoder.decode([JobRows(seq_id, done, cached.tokens[done : done + n], False)], shapes)
            done += n
    except Exception:
        log.exception("could not evaluate a cached prefix again; keeping what is done")
        try:
            runtime.remove(seq_id, done)
        except Exception:
            log.exception("could not trim it either; dropping it")
            sessions.drop_prefix(seq_id)
            return done - start
    # In its place in the cache's order, its age unchanged.
    kept = replace(cached, tokens=cached.tokens[:done], tiled=min(done, tiled_to))
    sessions.prefix_reuse.keep(seq_id, kept)
    return done - start
