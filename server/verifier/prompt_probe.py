"""The startup probe's prompt checks: the same prompt evaluated in passes cut in other
places must give the same logits for its next token, for each way the engine cuts
prompts (prompt_cuts.py). Each returns the largest difference (0.0: exact)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from server.verifier.jobs import JobRows
from server.verifier.passes import PassShapes

PROBE_PROMPT = 128  # the chunking check's prompt: past the lengths where kernels change


class PromptTarget(Protocol):
    n_batch: int

    def decode_jobs(self, jobs: Sequence[JobRows], shapes: PassShapes) -> list[np.ndarray]: ...

    def evaluate_prompt(
        self, seq_id: int, tokens: Sequence[int], start: int, chunk: int, shapes: PassShapes
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
    """A prompt's tiled part (every token but the next, longer than two passes of
    `tile_rows`) evaluated in one pass against cut into passes of at least `tile_rows`
    elsewhere: where a cached prefix ends and a cold prompt goes on."""
    ids = text_ids[: min(2 * tile_rows + 37, target.n_batch) + 1]
    n = len(ids) - 1
    cuts = ((n,), (tile_rows, n - tile_rows), (n - tile_rows, tile_rows))
    return largest_difference(target, shapes, ids, cuts)


def stretch_cuts_difference(
    target: PromptTarget, shapes: PassShapes, tile_rows: int, text_ids: Sequence[int]
) -> float:
    """A chat prompt's shape: a stretch below the tile (a reply), then a tiled one, then
    the rest below, each cut in other places (a tiled stretch's passes at least
    `tile_rows` long): a tiled stretch's numbers must not depend on where it starts or
    how the cells before it were cut."""
    head = tail = min(37, tile_rows - 1)
    tiled = min(2 * tile_rows + 5, target.n_batch)
    ids = text_ids[: head + tiled + tail + 1]
    halves = (head // 2, head - head // 2)
    cuts = (
        (head, tiled, tail),
        (*halves, tile_rows, tiled - tile_rows, *halves),
        (head, tiled - tile_rows, tile_rows, tail),
    )
    return largest_difference(target, shapes, ids, [[c for c in cut if c] for cut in cuts])


def largest_difference(
    target: PromptTarget, shapes: PassShapes, ids: Sequence[int], cuts: Sequence[Sequence[int]]
) -> float:
    """The next token's logits after `ids` but its last, that prompt evaluated in passes
    of each list of `cuts`, against the first list's: the largest difference."""
    *prompt, last = ids
    n = len(prompt)
    rows = []
    for sizes in cuts:
        target.remove(0, -1)
        start = 0
        for size in sizes:
            target.evaluate_prompt(0, prompt[start : start + size], start, size, shapes)
            start += size
        assert start == n, "the cuts must cover the prompt"
        rows.append(target.decode_jobs([JobRows(0, n, [last], True)], shapes)[0][0])
    return max(float(np.max(np.abs(rows[0].astype(np.float64) - row))) for row in rows[1:])


def _chunks(n: int, chunk: int) -> list[int]:
    return [min(chunk, n - s) for s in range(0, n, chunk)]
