"""Pure: where a prompt is cut into decodes, and how much of a cached prefix a prompt may
keep, so that a prompt's numbers are the same cold, reused and reopened.

A kernel may take another path from some number of rows of one sequence in a pass (the
CPU build's flash attention works in tiles of 64 query rows from 64 rows on), and a row's
numbers then depend on which path computed it, not on which other rows shared its pass
(docs/numerics.md, "Prompt chunks and prompt reuse"). So a prompt is evaluated in two
parts, each a function of the prompt alone:

- its tiled part, positions [0, tiled_end): in passes of at least `tile_rows` rows, cut
  anywhere (the tiled path's numbers do not depend on the cuts), as large as the decoder
  allows: the machine's speed for a cold prompt;
- the rest: in passes of fewer rows (cut anywhere too), as generated tokens are.

The tiled part ends at the last multiple of `tile_rows` in the prompt (its last token
left out: that one is the first round's row), so that a conversation's next turn, which
repeats this one and adds a little, mostly ends its tiled part at the same place and
keeps every cell; a prompt shorter than two tiles is tiled whole if it fills one (one
pass, no rest), and not at all if it does not. A reopened session's tiled part ends
where its original prompt's did. A cached prefix remembers how many of its cells are
tiled; a prompt keeps the cells that are what its own cold evaluation would write, and
never leaves a tiled remainder shorter than `tile_rows` to evaluate. Idle, the verifier
evaluates a cached prefix again the way a prompt ending in its last tile would
(`retile_plan`). `tile_rows` 0: one path for every row count, nothing tiled.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptCuts:
    """How this server cuts prompts: `chunk` tokens a decode at most (`interleaved` while
    rounds wait their turn), and with `tile_rows` > 0 a tiled part and the rest in
    passes of at most `tile_rows` - 1."""

    chunk: int
    tile_rows: int = 0

    @property
    def small(self) -> int:
        return self.tile_rows - 1 if self.tile_rows else self.chunk

    @property
    def interleaved(self) -> int:
        return 2 * self.tile_rows if self.tile_rows else self.chunk

    def piece(self, done: int, tiled_to: int, total: int, interleaved: bool = False) -> int:
        size = self.interleaved if interleaved else self.chunk
        return next_piece(done, tiled_to, total, size, self.small, self.tile_rows)


def tiled_end(prompt_len: int, tile_rows: int) -> int:
    """Where a prompt's tiled part ends, of its tokens but the last (the first round's
    row): the last multiple of `tile_rows`; all of them below two tiles; none below one."""
    evaluated = prompt_len - 1
    if not tile_rows or evaluated < tile_rows:
        return 0
    if evaluated < 2 * tile_rows:
        return evaluated
    return evaluated - evaluated % tile_rows


def next_piece(done: int, tiled_to: int, total: int, size: int, small: int, tile_rows: int) -> int:
    """How many tokens the next decode of a prompt takes, `done` of `total` evaluated:
    within the tiled part at most `size` but never fewer than `tile_rows`, and never
    leaving fewer than `tile_rows` of it for later; after it at most `small` (< tile_rows).
    """
    if done < tiled_to:
        left = tiled_to - done
        if left <= size:
            return left
        return size if left - size >= tile_rows else left - tile_rows
    return min(small, total - done)


def reusable(common: int, cached_tiled: int, prompt_tiled_end: int, tile_rows: int) -> int:
    """How many of a cached prefix's cells a prompt keeps. The prefix shares `common`
    tokens with the prompt; its first `cached_tiled` cells were written in tiled passes,
    the rest in passes of fewer rows. The prompt's own cold evaluation tiles its first
    `prompt_tiled_end` positions and not the rest: the kept cells must be exactly those,
    and what is left of the tiled part must fill a pass."""
    if not tile_rows:
        return common
    kept = common
    if cached_tiled != prompt_tiled_end:
        kept = min(common, cached_tiled, prompt_tiled_end)
    if kept < prompt_tiled_end and prompt_tiled_end - kept < tile_rows:
        kept = max(0, prompt_tiled_end - tile_rows)
    return kept


def retile_plan(n_cells: int, cached_tiled: int, tile_rows: int) -> tuple[int, int] | None:
    """A cached prefix of `n_cells` cells, its first `cached_tiled` tiled, evaluated again
    as a prompt ending in its last tile would be: (start, tiled_to), its cells from
    `start` removed, [start, tiled_to) evaluated in tiled passes (from early enough to
    fill one: tiled cells evaluated again come out the same), the rest in passes below
    the tile; None when there is nothing to do."""
    if not tile_rows or n_cells < 2 * tile_rows:
        return None
    tiled_to = n_cells - n_cells % tile_rows
    if cached_tiled >= tiled_to:
        return None
    return min(cached_tiled, tiled_to - tile_rows), tiled_to
