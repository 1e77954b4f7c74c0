"""The startup probe's prompt checks: the same prompt evaluated in passes cut in other
places must give the same logits for its next token, for each way the engine cuts
prompts (prompt_cuts.py). Each returns the largest difference (0.0: exact)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from server.verifier.decoding.jobs import JobRows
from server.verifier.decoding.passes import PassShapes

PROBE_PROMPT = 128  # the chunking check's prompt: past the lengths where kernels change


class PromptTarget(Protocol):
    n_batch: int
    n_ctx_per_seq: int

    def decode_jobs(self, jobs: Sequence[JobRows], shapes: PassShapes) -> list[np.ndarray]: ...

    def evaluate_prompt(
        self,
        seq_id: int,
        tokens: Sequence[int],
        start: int,
        chunk: int,
        shapes: PassShapes,
        min_rows: int = 0,
    ) -> None: ...

    def remove(self, seq_id: int, p0: int, p1: int = -1) -> None: ...


def chunking_difference(
    target: PromptTarget, shapes: PassShapes, chunk: int, text_ids: Sequence[int]
) -> float:
    """A prompt (the first tokens of `text_ids`) evaluated in chunks of `chunk` tokens
    from its start against cut elsewhere. The cuts fall off any power-of-two grid:
    kernels that work in tiles of rows agree with themselves when cuts fall on tiles."""
    ids = text_ids[: min(chunk, PROBE_PROMPT) + 1]
    n = len(ids) - 1
    odd = min(37, n // 2) | 1
    cuts = [_chunks(first, chunk) + _chunks(n - first, chunk) for first in (n, odd, n - 1)]
    return largest_difference(target, shapes, ids, cuts)


def tiled_cuts_difference(
    target: PromptTarget, shapes: PassShapes, tile_rows: int, text_ids: Sequence[int]
) -> float:
    """A chat prompt's shape: a tiled stretch from position 0, a reply below the tile, a
    second tiled stretch, the rest below; evaluated with each part in one pass against
    every part cut elsewhere (tiled passes at least `tile_rows` long): a tiled stretch's
    numbers must not depend on where it starts or is cut (where a cached prefix ends and
    a prompt goes on), nor on how the cells before it were cut."""
    small = tile_rows - 1
    tiled = min(2 * tile_rows + 5, target.n_batch)
    reply, tail = min(20, small), min(10, small)
    whole = [tiled, reply, tiled, tail]
    split = (tiled - tile_rows, tile_rows)
    cut = [tile_rows, tiled - tile_rows, *_halves(reply), *split, *_halves(tail)]
    if sum(whole) >= min(target.n_ctx_per_seq, len(text_ids)):  # too long: one stretch
        tiled = min(tiled, len(text_ids) - 1)
        if tiled < 2 * tile_rows:
            return math.inf  # no text to check so wide a tile with: not taken
        whole, cut = [tiled], [tile_rows, tiled - tile_rows]
    ids = text_ids[: sum(whole) + 1]
    return largest_difference(target, shapes, ids, [whole, [c for c in cut if c]])


def padded_difference(
    target: PromptTarget, shapes: PassShapes, tile_rows: int, text_ids: Sequence[int]
) -> float:
    """A tiled stretch after a tile's cells, in one pass, against the same stretch in two
    passes shorter than a tile, each padded to one (the padding's cells removed after):
    the padding must change nothing, neither in the rows padded nor in what follows."""
    n = 2 * tile_rows + 3
    if n >= len(text_ids) or n + tile_rows > target.n_ctx_per_seq:
        return math.inf  # no text or no room to check it with: not taken
    short = tile_rows // 2 + 1
    cuts = [[tile_rows, n - tile_rows], [tile_rows, short, n - tile_rows - short]]
    return largest_difference(target, shapes, text_ids[: n + 1], cuts, min_rows=tile_rows)


def largest_difference(
    target: PromptTarget,
    shapes: PassShapes,
    ids: Sequence[int],
    cuts: Sequence[Sequence[int]],
    min_rows: int = 0,
) -> float:
    """The next token's logits after `ids` but its last, that prompt evaluated in passes
    of each list of `cuts` (each padded to `min_rows`), against the first list's: the
    largest difference."""
    *prompt, last = ids
    n = len(prompt)
    rows = []
    for sizes in cuts:
        target.remove(0, -1)
        start = 0
        for size in sizes:
            piece = prompt[start : start + size]
            target.evaluate_prompt(0, piece, start, size, shapes, min_rows)
            start += size
        assert start == n, "the cuts must cover the prompt"
        rows.append(target.decode_jobs([JobRows(0, n, [last], True)], shapes)[0][0])
    return max(float(np.max(np.abs(rows[0].astype(np.float64) - row))) for row in rows[1:])


def _halves(n: int) -> tuple[int, int]:
    return n // 2, n - n // 2


def _chunks(n: int, chunk: int) -> list[int]:
    return [min(chunk, n - s) for s in range(0, n, chunk)]
