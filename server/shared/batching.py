"""Batched decoding, one way for both sides: several sequences' rows in one
`llama_decode`, cells that were only there to shape the pass removed after it, and a
failed decode tried again one job at a time so that only a job at fault fails.

Also the one place that knows how llama.cpp cuts a decode into forward passes
(micro-batches, "ubatches"): `forward_passes` mirrors `llama_batch_allocr::split_equal`
with `sequential` set, which is what a context with one KV stream per sequence
(`kv_unified` off) uses. A pass takes only sequences whose ids rise by one in batch
order, and as many rows of each as the one with the fewest has; each pass reads every
weight of the model once. tests/integration/test_passes.py holds this mirror against
llama.cpp itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from server.shared.runtime import BatchEntry

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class DecodingRuntime(Protocol):
    n_vocab: int

    def decode(self, entries: Sequence[BatchEntry], every_logit: bool = False) -> np.ndarray: ...

    def remove(self, seq_id: int, p0: int, p1: int = -1) -> None: ...


@dataclass(frozen=True, slots=True)
class Piece:
    """One sequence's rows in a decode: `tokens` at positions `start`, `start + 1`, ...;
    the logits of the rows in `logits` are returned; the cells of rows from `keep` on
    (padding, fillers) are removed once the decode is done."""

    seq_id: int
    start: int
    tokens: Sequence[int]
    logits: Sequence[int] = ()
    keep: int | None = None  # None: every row's cells stay

    @property
    def kept(self) -> int:
        return len(self.tokens) if self.keep is None else self.keep


def decode_pieces(
    runtime: DecodingRuntime, pieces: Sequence[Piece], every_logit: bool = False
) -> list[np.ndarray]:
    """One llama_decode of every piece, in the order given; each piece's logits rows
    (`every_logit`: every row's computed, those asked for returned).
    If it fails, or a piece's padding or filler cells cannot be removed after it, every
    piece's cells from its start are removed and the error raised: the sequences are as
    they were."""
    entries = []
    for piece in pieces:
        wanted = set(piece.logits)
        entries += [
            BatchEntry(token, piece.start + i, piece.seq_id, i in wanted)
            for i, token in enumerate(piece.tokens)
        ]
    try:
        rows = runtime.decode(entries, every_logit)
    except Exception:
        for piece in pieces:
            forget(runtime, piece.seq_id, piece.start)
        raise
    out, row, refused = [], 0, None
    for piece in pieces:
        n = len(piece.logits)
        out.append(rows[row : row + n])
        row += n
        if piece.kept < len(piece.tokens):
            try:
                runtime.remove(piece.seq_id, piece.start + piece.kept)
            except Exception as exc:  # the other pieces' shaping cells go all the same
                refused = refused or exc
    if refused is not None:
        # A shaping cell left behind would sit in a sequence, perhaps another key's: the
        # decode is undone as a failed one is, and raised.
        for piece in pieces:
            forget(runtime, piece.seq_id, piece.start)
        raise refused
    return out


def forget(runtime: DecodingRuntime, seq_id: int, p0: int) -> bool:
    """Remove a sequence's cells from `p0` on; False (logged) if llama.cpp refused."""
    try:
        runtime.remove(seq_id, p0)
        return True
    except Exception:
        log.exception("could not remove the cells of sequence %d from %d", seq_id, p0)
        return False


def together_or_alone(
    items: Sequence[T], decode: Callable[[Sequence[T]], Sequence[R]]
) -> Sequence[R | Exception]:
    """`decode(items)`, one result per item; if that raises, each item decoded alone, so
    that only an item that cannot be decoded fails: its exception stands in its place.
    `decode` must leave nothing behind when it raises (decode_pieces does not)."""
    try:
        return decode(items)
    except Exception as exc:
        if len(items) == 1:
            return [exc]
        log.warning("a decode of %d jobs failed (%s): decoding them one by one", len(items), exc)
        return [result for item in items for result in together_or_alone([item], decode)]


def chunk_len(done: int, total: int, size: int) -> int:
    """How many of a long input's remaining tokens go in its next decode: at most `size`,
    so that it is cut at the same places (`done` + multiples of `size`) however busy the
    decoder is."""
    return min(size, total - done)


def forward_passes(seq_ids: Sequence[int], n_ubatch: int) -> list[int]:
    """The rows of each forward pass llama.cpp makes of one decode whose rows belong to
    `seq_ids`, in batch order (one KV stream per sequence):
    `llama_batch_allocr::split_equal(n_ubatch, sequential=true)`."""
    by_seq: dict[int, list[int]] = {}
    for i, seq_id in enumerate(seq_ids):
        by_seq.setdefault(seq_id, []).append(i)
    used = [False] * len(seq_ids)
    passes = []
    while not all(used):
        members: list[int] = []
        for i, seq_id in enumerate(seq_ids):
            if used[i] or seq_id in members:
                continue
            if not members or seq_id == members[-1] + 1:
                members.append(seq_id)
                if len(members) > n_ubatch:
                    break
        left = {seq: [i for i in by_seq[seq] if not used[i]] for seq in members}
        rows = 0
        while all(left[seq] for seq in members):
            for seq in members:
                used[left[seq].pop(0)] = True
            rows += len(members)
            if (rows // len(members) + 1) * len(members) > n_ubatch:
                break
        passes.append(rows)
    return passes
