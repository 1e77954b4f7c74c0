"""The startup probe's round checks (invariance.py runs them): a round's rows decoded one
at a time, alone, in the largest pass, and beside a long sequence, compared bit for bit.
Each leaves every sequence holding the short context it filled."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from server.verifier.decoding.jobs import JobRows
from server.verifier.decoding.passes import PassShapes
from server.verifier.probe.prompt_probe import PromptTarget

PROBE_CONTEXT = 24  # tokens each sequence holds before the probed rounds


class ProbeTarget(PromptTarget, Protocol):
    """What the probe decodes through: the prompt checks' target, its sequences, and a
    tokenizer."""

    n_seq: int

    def tokenize(self, text: str, *, add_special: bool) -> list[int]: ...


@dataclass(frozen=True)
class InvarianceReport:
    batch_invariant: bool
    max_abs_diff: float  # the largest logit difference between any two ways
    argmax_agrees: bool  # the greedy choice at every probed position, all ways
    positions: int
    pinned_width: int = 0  # > 0: every pass is every sequence this many rows wide
    pinned_logits: bool = False  # pinned passes compute every row's logits
    prefill_chunk_invariant: bool = True  # a prompt cut elsewhere gives the same logits
    prefill_chunk_max_diff: float = 0.0
    prompt_chunk: int = 0  # the chunk length those two describe
    prompt_tile_rows: int = 0  # > 0: prompts' tiled parts go in passes of this many rows or more
    prompt_padded: bool = False  # a tiled pass padded to prompt_tile_rows gives the same numbers
    pass_cost_rows: float = 0.0  # one pass costs as much as this many rows
    # Passes timed, (rows, seconds): a session's round alone of one row and of a short
    # draft, and every sequence's round in one pass.
    pass_s: tuple[tuple[int, float], ...] = ()


def compare(reference: np.ndarray, others: list[np.ndarray]) -> InvarianceReport:
    """Bit-for-bit comparison of logits rows from several ways of batching (pure)."""
    diff = 0.0
    argmax_agrees = True
    for rows in others:
        if rows.shape != reference.shape:
            raise ValueError(f"probe rows {rows.shape} against {reference.shape}")
        diff = max(diff, float(np.max(np.abs(rows.astype(np.float64) - reference))))
        argmax_agrees &= bool(np.array_equal(rows.argmax(axis=1), reference.argmax(axis=1)))
    return InvarianceReport(
        batch_invariant=diff == 0.0,
        max_abs_diff=diff,
        argmax_agrees=argmax_agrees,
        positions=reference.shape[0],
    )


def _context(ids: Sequence[int], seq_id: int) -> list[int]:
    """A context of its own for each sequence: the probe text rotated."""
    shift = (seq_id * 5) % (len(ids) - PROBE_CONTEXT)
    return list(ids[1 + shift : 1 + shift + PROBE_CONTEXT - 1])


def fill_contexts(
    target: ProbeTarget, shapes: PassShapes, ids: Sequence[int], seq_ids: Sequence[int] = ()
) -> None:
    """The short context into `seq_ids` (every sequence if none)."""
    chunk = shapes.pinned_width or min(PROBE_CONTEXT, target.n_batch)
    for seq_id in seq_ids or range(target.n_seq):
        target.remove(seq_id, -1)
        target.evaluate_prompt(seq_id, [ids[0], *_context(ids, seq_id)], 0, chunk, shapes)


def round_tokens(ids: Sequence[int], seq_id: int, n: int) -> list[int]:
    start = PROBE_CONTEXT + (seq_id * 3) % max(1, len(ids) - PROBE_CONTEXT - n)
    return list(ids[start : start + n])


def rounds_difference(
    target: ProbeTarget,
    shapes: PassShapes,
    ids: Sequence[int],
    round_rows: int,
    long_ids: Sequence[int] = (),
) -> InvarianceReport:
    """Rounds one row at a time, alone, and in the largest pass, compared; with
    `long_ids` (more cells than the short context), the largest pass again with sequence
    0 long (_long_round): the other sequences' rows then attend over its span."""
    fill_contexts(target, shapes, ids)
    probed = sorted({target.n_seq // 2, target.n_seq - 1})
    lengths = {
        s: round_rows if s in probed else 1 + (s * 7) % round_rows for s in range(target.n_seq)
    }
    rounds = {s: round_tokens(ids, s, lengths[s]) for s in range(target.n_seq)}

    def decode(jobs: list[JobRows], shapes: PassShapes = shapes) -> list[np.ndarray]:
        try:
            return target.decode_jobs(jobs, shapes)
        finally:
            for job in jobs:
                target.remove(job.seq_id, PROBE_CONTEXT)

    references = {
        s: np.concatenate(
            [
                target.decode_jobs([JobRows(s, PROBE_CONTEXT + i, [token], True)], shapes)[0]
                for i, token in enumerate(rounds[s])
            ]
        )
        for s in probed
    }
    for s in probed:
        target.remove(s, PROBE_CONTEXT)
    alone = {s: decode([JobRows(s, PROBE_CONTEXT, rounds[s], True)])[0] for s in probed}
    # Every round in one pass, whatever the pass cost the settings give: the widest pass
    # the scheduler can make.
    widest = replace(shapes, pass_cost_rows=float(shapes.max_rows))
    largest = decode([JobRows(s, PROBE_CONTEXT, rounds[s], True) for s in rounds], widest)
    ways = {s: [alone[s], largest[s]] for s in probed}
    long = None
    if len(long_ids) > PROBE_CONTEXT + round_rows:
        others = [JobRows(s, PROBE_CONTEXT, rounds[s], True) for s in rounds if s != 0]
        try:
            long, beside = _long_round(target, widest, long_ids, round_rows, len(rounds[0]), others)
        finally:
            fill_contexts(target, shapes, ids, [0])  # the short context again
        for job, got in zip(others, beside, strict=True):
            if job.seq_id in ways:
                ways[job.seq_id].append(got)
    reports = [compare(references[s], ways[s]) for s in probed]
    worst = max(reports, key=lambda r: r.max_abs_diff)
    worst = replace(worst, batch_invariant=all(r.batch_invariant for r in reports))
    return worst if long is None else _worse(worst, long)


def _long_round(
    target: ProbeTarget,
    shapes: PassShapes,
    ids: Sequence[int],
    round_rows: int,
    first_rows: int,
    others: list[JobRows],
) -> tuple[InvarianceReport, list[np.ndarray]]:
    """Sequence 0 made long (`ids` but a round), a round after it one row at a time
    against the round in one pass (the CPU flash attention splits a lone row's keys past
    256 cells), and its first `first_rows` rows in one pass with the `others` (each
    sequence's stretch of the largest pass): llama.cpp's attention spans as many cells
    for every sequence of a pass as its longest holds (`n_kv`). Returns the others' rows
    too. Leaves sequence 0 empty."""
    context = len(ids) - round_rows
    long_round = ids[context:]
    target.remove(0, -1)
    try:
        target.evaluate_prompt(0, ids[:context], 0, shapes.pinned_width or target.n_batch, shapes)
        reference = np.concatenate(
            [
                target.decode_jobs([JobRows(0, context + i, [token], True)], shapes)[0]
                for i, token in enumerate(long_round)
            ]
        )
        target.remove(0, context)
        report = compare(
            reference, [target.decode_jobs([JobRows(0, context, long_round, True)], shapes)[0]]
        )
        target.remove(0, context)
        if not others:
            return report, []
        own = JobRows(0, context, long_round[:first_rows], True)
        try:
            rows = target.decode_jobs([own, *others], shapes)
        finally:
            for job in others:
                target.remove(job.seq_id, PROBE_CONTEXT)
    finally:
        target.remove(0, -1)
    # Positions counted once: these rows are the first of the round compared above.
    beside = replace(compare(reference[:first_rows], rows[:1]), positions=0)
    return _worse(report, beside), rows[1:]


def _worse(a: InvarianceReport, b: InvarianceReport) -> InvarianceReport:
    """Two checks of the same shapes as one report: exact only if both are."""
    return replace(
        a,
        batch_invariant=a.batch_invariant and b.batch_invariant,
        max_abs_diff=max(a.max_abs_diff, b.max_abs_diff),
        argmax_agrees=a.argmax_agrees and b.argmax_agrees,
        positions=a.positions + b.positions,
    )
