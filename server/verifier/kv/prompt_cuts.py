"""Pure: where a prompt is cut into decodes, and how much of a cached prefix a prompt may
keep, so that a prompt's numbers are the same cold, reused and reopened.

A kernel may take another path from some number of rows of one sequence in a pass (the
CPU build's flash attention works in tiles of 64 query rows from 64 rows on), and a row's
numbers then depend on which path computed it, not on which other rows shared its pass
(docs/numerics.md, "Prompt chunks and prompt reuse"). So each position of a prompt is
written by one path, a function of the prompt's tokens alone (its `Tiling`):

- tiled stretches: in passes of at least `tile_rows` rows of the stretch, cut anywhere
  (the tiled path's numbers do not depend on the cuts), as large as the decoder allows:
  the machine's speed for a cold prompt; a stretch shorter than a tile goes tiled in one
  pass padded to `tile_rows` rows (the padding's cells removed after) where that costs
  less than its rows below the tile (`pads`);
- the rest: in passes of fewer rows (cut anywhere too), as generated tokens are.

A prompt is read as stretches of text between the model's replies: a reply starts after
the reply opener the chat template writes (`<|im_start|>assistant\n`) and ends before the
next end-of-turn token; a prompt with no opener is one stretch. Replies are evaluated
below the tile, as the rounds that generated them were, so a conversation's next turn,
sent at once, keeps its earlier answers' cells. A stretch with at least `tile_rows`
tokens to evaluate (all of them but the last: in the prompt that ended there, that one was
the first round's row) is tiled whole, the last pass of it never below a tile; a shorter
one goes in one padded pass where `pads` says so (a function of where the stretch starts
and how long it is), below the tile otherwise. So a stretch is cut the same way in every
prompt that holds it whole, and only a prompt's last stretch changes with the next turn.
A reopened session's generated tokens are below the tile. A cached prefix remembers its
tiling; a prompt keeps the cells that are what its own cold evaluation would write, and
never leaves a tiled remainder shorter than `tile_rows` to evaluate (a short span is
evaluated again whole). Idle, the verifier evaluates a cached
prefix's last stretch again the way a prompt going on from it would (`retile_plan`).
`tile_rows` 0: one path for every row count, nothing tiled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# Tiled spans [start, end), in order, apart, each at least a tile long or padded to one;
# the rest below.
Tiling = tuple[tuple[int, int], ...]

# What padding a short stretch to a tiled pass costs against its rows below the tile, in
# one unit (a row's attention over one cell): below the tile each row's attention runs
# alone over the context (ROW_CELLS: the rest of a row's work, in those units), while a
# tiled pass's rows share theirs (a tile's rows cost TILE_SHARE of that, over the context
# and TILE_CELLS). Fit to the CPU build's passes of 1 to 64 rows after 100 to 2,000 cells
# (scripts/gpu/physics.py). A cost only: the output is exact whatever it says, since the
# choice is a function of the prompt alone.
ROW_CELLS = 128
TILE_CELLS = 2600
TILE_SHARE = 16  # a tile's rows cost 1/TILE_SHARE of as many rows below the tile
PAD_MODES = ("auto", "always", "off")


@dataclass(frozen=True)
class Replies:
    """Where a chat prompt holds the model's replies: after `opener`, up to an `ends`
    token. No opener: no replies (every prompt one stretch)."""

    opener: tuple[int, ...] = ()
    ends: frozenset[int] = field(default_factory=frozenset)


@dataclass(frozen=True)
class PromptCuts:
    """How this server cuts prompts: `chunk` tokens a decode at most (`interleaved` while
    rounds wait their turn), and with `tile_rows` > 0 tiled stretches and the rest in
    passes of at most `tile_rows` - 1."""

    chunk: int
    tile_rows: int = 0
    replies: Replies = Replies()
    pad: str = "off"  # short stretches padded to a tiled pass: "auto" (where cheaper), "always"

    @property
    def small(self) -> int:
        return self.tile_rows - 1 if self.tile_rows else self.chunk

    @property
    def interleaved(self) -> int:
        return 2 * self.tile_rows if self.tile_rows else self.chunk

    def tiling(self, tokens: Sequence[int], prompt_len: int) -> Tiling:
        return prompt_tiling(tokens, prompt_len, self.tile_rows, self.replies, self.pad)

    def piece(self, done: int, tiling: Tiling, total: int, interleaved: bool = False) -> int:
        size = self.interleaved if interleaved else self.chunk
        return next_piece(done, tiling, total, size, self.small, self.tile_rows)

    def pass_rows(self, done: int, tiling: Tiling) -> int:
        """The fewest rows the pass of the piece from `done` has: a tile in a tiled span
        (a short span's piece padded to it), none below the tile."""
        return self.tile_rows if span_at(tiling, done) is not None else 0


def tiled_end(stretch_len: int, tile_rows: int, start: int = 0, pad: str = "off") -> int:
    """Where a stretch from `start` has its tiled part end, from its start: all of its
    tokens but the last where they fill a tile or `pads` says so, none otherwise. (Below
    the tile, a row's attention costs several times what it costs in a tiled pass once the
    context is long, so a stretch's remainder is not left below it.)"""
    evaluated = stretch_len - 1
    if not tile_rows or evaluated < 1:
        return 0
    return evaluated if evaluated >= tile_rows or pads(start, evaluated, tile_rows, pad) else 0


def pads(start: int, rows: int, tile_rows: int, pad: str) -> bool:
    """Whether `rows` (< tile_rows) of a stretch from `start` go in one pass padded to a
    tile: "always", "off", or "auto": where that costs less than the rows below it."""
    if pad == "auto":
        return rows * (start + ROW_CELLS) * TILE_SHARE >= tile_rows * (start + TILE_CELLS)
    return pad == "always"


def stretches(tokens: Sequence[int], prompt_len: int, replies: Replies) -> list[tuple[int, int]]:
    """The prompt's stretches outside replies, [start, end): each ends with a reply
    opener, or where the prompt does."""
    opener, found, start, p = replies.opener, [], 0, 0
    k = len(opener)
    while k and p + k <= prompt_len:
        if tokens[p] != opener[0] or tuple(tokens[p : p + k]) != opener:
            p += 1
            continue
        found.append((start, p + k))
        p += k
        while p < prompt_len and tokens[p] not in replies.ends:
            p += 1
        start = p
    if start < prompt_len:
        found.append((start, prompt_len))
    return found


def prompt_tiling(
    tokens: Sequence[int],
    prompt_len: int,
    tile_rows: int,
    replies: Replies = Replies(),
    pad: str = "off",
) -> Tiling:
    """What a prompt's cold evaluation tiles: each stretch's tiled part."""
    if not tile_rows:
        return ()
    spans = (
        (s, s + tiled_end(e - s, tile_rows, s, pad))
        for s, e in stretches(tokens, prompt_len, replies)
    )
    return tuple((s, e) for s, e in spans if e > s)


def clip(tiling: Tiling, n: int) -> Tiling:
    """The tiling of a prompt's first `n` positions."""
    return tuple((s, min(e, n)) for s, e in tiling if s < n)


def span_at(tiling: Tiling, position: int) -> tuple[int, int] | None:
    return next(((s, e) for s, e in tiling if s <= position < e), None)


def next_piece(done: int, tiling: Tiling, total: int, size: int, small: int, tile_rows: int) -> int:
    """How many tokens the next decode of a prompt takes, `done` of `total` evaluated:
    within a tiled span at most `size` but never fewer than `tile_rows` (a span shorter
    than that whole, its pass padded), and never leaving fewer than `tile_rows` of it for
    later; elsewhere at most `small` (< tile_rows), never into the next span."""
    span = span_at(tiling, done)
    if span is not None:
        left = span[1] - done
        if left <= size:
            return left
        return size if left - size >= tile_rows else left - tile_rows
    following = min((s for s, _ in tiling if s > done), default=total)
    return min(small, following - done, total - done)


def first_difference(a: Tiling, b: Tiling, limit: int) -> int:
    """The first position below `limit` that one tiling tiles and the other does not."""
    for p in sorted({0, *(x for span in (*a, *b) for x in span)}):
        if p >= limit:
            break
        if (span_at(a, p) is None) != (span_at(b, p) is None):
            return p
    return limit


def reusable(common: int, cached: Tiling, prompt: Tiling, tile_rows: int) -> int:
    """How many of a cached prefix's cells a prompt keeps. The prefix shares `common`
    tokens with the prompt; `cached` says which of its cells were written in tiled
    passes, `prompt` which positions the prompt's own cold evaluation tiles: the kept
    cells must be exactly those, and what is left of a tiled span must fill a pass."""
    if not tile_rows:
        return common
    kept = first_difference(cached, prompt, common)
    span = span_at(prompt, kept)
    if span is not None and span[0] < kept and span[1] - kept < tile_rows:
        kept = max(span[0], span[1] - tile_rows)
    return kept


def retile_plan(
    tokens: Sequence[int],
    cached: Tiling,
    tile_rows: int,
    replies: Replies = Replies(),
    pad: str = "off",
) -> tuple[int, Tiling] | None:
    """A cached prefix holding `tokens`, its cells tiled as `cached` says, evaluated again
    as a prompt that goes on from it would be: (start, tiling), its cells from `start`
    removed and evaluated again (from early enough to fill a tiled pass: tiled cells
    evaluated again come out the same); None when there is nothing to do. Only its last
    stretch can want it (a reply is below the tile already), only one of a tile or more
    (a prompt going on from it tiles all of it; from a shorter one, maybe not), and only
    where a tile of cells or more differ (for fewer, a tiled pass would be spent on
    what a next prompt going on far enough evaluates again within its own)."""
    n, opener = len(tokens), replies.opener
    found = stretches(tokens, n, replies) if tile_rows else []
    if not found or found[-1][1] != n or n - found[-1][0] < tile_rows:
        return None
    if opener and tuple(tokens[n - len(opener) :]) == opener:
        return None  # its last stretch is closed: a next prompt holds it whole, as cut
    last = found[-1][0]
    target = (*prompt_tiling(tokens, last, tile_rows, replies, pad), (last, n))
    if n - first_difference(cached, target, n) < tile_rows:
        return None
    return reusable(n, cached, target, tile_rows), target
