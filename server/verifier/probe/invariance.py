"""Does this build, on this device, give a row the same logits in every pass shape the
scheduler makes? Checked at startup, where the server runs (docs/numerics.md).

Greedy speculative decoding is token for token the verifier's own output only if a row's
logits do not depend on the pass it was computed in: a round decodes k+1 rows at once,
beside other sessions' rounds (padded to one width, with filler rows for sequences in
between: server/verifier/decoding/passes.py), where the verifier alone decodes one row. So the
probe fills every sequence with a context and compares, bit for bit:

1. a round's rows decoded one at a time (how `/generate` sees them when nobody else is
   about), against
2. the same round alone, and
3. the same round in the largest pass the scheduler makes: every sequence with a round,
   rounds of unequal lengths padded to the widest, as many rows as a pass can have, and
4. the largest pass again with one sequence long: llama.cpp's attention spans as many
   cells for every sequence of a pass as its longest holds (`n_kv`), and CUDA's flash
   attention divides the keys by that span.

Where free shapes differ (GPU kernels chosen by the row count), it tries pinned ones:
every pass every sequence at one width (`VERIFIER_PIN_SHAPES`). Timed passes give the
planner how many rows one pass costs.

A prompt's numbers must not depend on where it is cut into chunks, or a cached prefix
would answer otherwise than a cold prompt: the probe checks the cuts the engine would
make (probe() says which) and reports the first chunk length that agrees.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from server.verifier.decoding.jobs import JobRows
from server.verifier.decoding.passes import PassShapes
from server.verifier.probe.prompt_probe import (
    chunking_difference,
    padded_difference,
    tiled_cuts_difference,
)
from server.verifier.probe.round_probe import (
    PROBE_CONTEXT,
    InvarianceReport,
    ProbeTarget,
    fill_contexts,
    round_tokens,
    rounds_difference,
)
from server.verifier.settings import VerifierSettings

if TYPE_CHECKING:  # verdict_cache hashes this module's code
    from server.verifier.probe.verdict_cache import VerdictCache

PROBE_TEXT = (
    "Speculative decoding checks a whole draft in one pass, so the numbers must not "
    "depend on the batch: 3, 5, 8, 13, 21."
)
# A longer context for one sequence, past 256 cells: from there llama.cpp's CPU flash
# attention splits a lone row's keys between threads (docs/numerics.md).
LONG_CONTEXT = 320
# Shorter prompt chunks tried when prompt reuse is wanted and n_batch is not exact.
AUTO_PROMPT_CHUNKS = (48, 32, 16)
TIMED_REPEATS = 3
# The rounds the pass cost is measured with: of the size rounds usually have (k = 4).
TIMED_ROUND_ROWS = 5


def prompt_chunks(n_batch: int, requested: int, reuse: bool, shortest: int) -> list[int]:
    """Prompt chunk lengths to probe, the preferred first: `requested` (0 = n_batch); with
    reuse wanted and nothing requested, shorter ones too, down to `shortest` (a round's
    rows: a reused prefix holds rounds, which must take the kernels a chunk takes). Reuse
    is exact only where a prompt's numbers do not depend on its cuts: short chunks cost a
    cold prompt time and save every later turn of a conversation."""
    first = min(requested or n_batch, n_batch)
    if requested or not reuse:
        return [first]
    return [first, *(n for n in AUTO_PROMPT_CHUNKS if shortest <= n < first)]


def probe_engine(
    decoder: ProbeTarget,
    settings: VerifierSettings,
    reuse: bool,
    verdicts: VerdictCache | None = None,
) -> tuple[InvarianceReport, PassShapes]:
    """The engine's probe, from its settings: the report, and the pass shapes to use
    (pinned or free, each pass's cost in rows measured unless the settings give it).
    With `verdicts`, an earlier start's verdicts on the same inputs are taken, and only
    the passes timed again."""
    arguments = probe_arguments(decoder, settings, reuse)
    report = verdicts.read(arguments) if verdicts is not None else None
    if report is None:
        report = probe(**arguments)
        if verdicts is not None:
            verdicts.write(arguments, report)
    elif not report.pinned_width:
        report = timed_again(decoder, arguments["free"], arguments["round_rows"], report)
    shapes = replace(
        arguments["free"],
        pass_cost_rows=settings.pass_cost_rows or report.pass_cost_rows,
        pinned_width=report.pinned_width,
        pinned_logits=report.pinned_logits,
    )
    return report, shapes


def probe_arguments(decoder: ProbeTarget, settings: VerifierSettings, reuse: bool) -> dict:
    """probe()'s arguments as the engine's settings give them (scripts/gpu/shapes.py runs
    the probe with some of them changed)."""
    round_rows = settings.max_draft + 1
    return {
        "target": decoder,
        "free": PassShapes(
            n_seq=decoder.n_seq,
            max_rows=min(decoder.n_batch, decoder.n_seq * round_rows),
            pass_cost_rows=settings.pass_cost_rows,
        ),
        "round_rows": round_rows,
        "pin": settings.pin_shapes,
        "pin_width": settings.pin_width or round_rows,
        "prompt_chunks": prompt_chunks(decoder.n_batch, settings.prompt_chunk, reuse, round_rows),
        "tile_rows": _tile_rows(decoder.n_batch, settings, round_rows),
        "long_context": min(
            LONG_CONTEXT,
            settings.n_ctx or decoder.n_ctx_per_seq,
            decoder.n_ctx_per_seq - 2 * max(round_rows, settings.pin_width),
        ),
    }


def _tile_rows(n_batch: int, settings: VerifierSettings, round_rows: int) -> int:
    """The tiled split to try (0: none): where a chunk can hold a tiled part twice over
    (so that a longer one is cut into passes of at least `tile_rows`) and a round stays
    below it. Tried with reuse on or off: a prompt's numbers are the same either way."""
    rows = settings.prompt_tile_rows
    chunk = min(settings.prompt_chunk or n_batch, n_batch)
    return rows if rows > round_rows and 2 * rows <= chunk else 0


def probe(
    target: ProbeTarget,
    free: PassShapes,
    *,
    round_rows: int,
    pin: str,
    pin_width: int,
    prompt_chunks: Sequence[int],
    tile_rows: int = 0,
    long_context: int = 0,
) -> InvarianceReport:
    """The shapes to use and whether they are exact. `free`: the planner's free shapes;
    `round_rows`: the longest round (max_draft + 1); `pin`: "auto" (pinned shapes if the
    free ones differ and pinned ones agree), "on" or "off"; `tile_rows` > 0: the tiled
    split to try where the first chunk length is not exact; `long_context` > the short
    one: a round after that many cells, and rounds beside them, are checked too. Leaves
    every sequence empty."""
    ids = target.tokenize(PROBE_TEXT * 4, add_special=True)
    long_ids = target.tokenize(PROBE_TEXT * 16, add_special=True)  # for the prompt checks

    def rounds(shapes: PassShapes) -> InvarianceReport:  # leaves the contexts _pass_cost uses
        long = long_ids[: long_context + round_rows] if long_context > PROBE_CONTEXT else ()
        return rounds_difference(target, shapes, ids, round_rows, long)

    try:
        report = rounds(free) if pin != "on" else None
        if pin != "off" and (report is None or not report.batch_invariant):
            pinned = replace(free, pinned_width=pin_width)
            pinned_report = replace(rounds(pinned), pinned_width=pin_width)
            if not pinned_report.batch_invariant:
                # llama.cpp runs the last layer's feed-forward part and the output
                # projection on the rows asked for only, and CUDA picks those kernels by
                # their number: every row's logits computed gives them one shape.
                every = replace(pinned, pinned_logits=True)
                every_report = replace(rounds(every), pinned_width=pin_width, pinned_logits=True)
                if every_report.max_abs_diff < pinned_report.max_abs_diff:
                    pinned_report = every_report
            if report is None or pinned_report.batch_invariant:
                report = pinned_report
        assert report is not None
        if not report.pinned_width:
            # Free shapes, exact or not, need the planner's trade between padding rows and
            # more passes: untimed, it would take every round as a pass of its own.
            rows = min(round_rows, TIMED_ROUND_ROWS)
            cost_rows, timed = _pass_cost(target, free, ids, rows)
            report = replace(report, pass_cost_rows=cost_rows, pass_s=timed)
        shapes = replace(free, pinned_width=report.pinned_width, pinned_logits=report.pinned_logits)
        chunks = [pin_width] if report.pinned_width else list(prompt_chunks)
        if not report.batch_invariant:
            chunks = chunks[:1]  # shorter chunks serve only reuse, which needs exact rounds
        diffs = [chunking_difference(target, shapes, chunks[0], long_ids)]
        if diffs[0] != 0.0 and tile_rows and report.batch_invariant and not report.pinned_width:
            split = max(
                tiled_cuts_difference(target, shapes, tile_rows, long_ids),
                chunking_difference(target, shapes, tile_rows - 1, long_ids),
            )
            if split == 0.0:
                return replace(
                    report,
                    prefill_chunk_invariant=True,
                    prefill_chunk_max_diff=0.0,
                    prompt_chunk=chunks[0],
                    prompt_tile_rows=tile_rows,
                    prompt_padded=padded_difference(target, shapes, tile_rows, long_ids) == 0.0,
                )
        for chunk in chunks[1:]:
            if diffs[-1] == 0.0:
                break
            diffs.append(chunking_difference(target, shapes, chunk, long_ids))
    finally:
        for seq_id in range(target.n_seq):
            target.remove(seq_id, -1)
    chosen = len(diffs) - 1 if diffs[-1] == 0.0 else 0  # the passing one, else the first
    return replace(
        report,
        prefill_chunk_invariant=diffs[chosen] == 0.0,
        prefill_chunk_max_diff=diffs[chosen],
        prompt_chunk=chunks[chosen],
    )


def timed_again(
    target: ProbeTarget, free: PassShapes, round_rows: int, report: InvarianceReport
) -> InvarianceReport:
    """`report` with its passes timed on this start (its verdicts taken as they are)."""
    ids = target.tokenize(PROBE_TEXT * 4, add_special=True)
    try:
        fill_contexts(target, free, ids)
        cost_rows, timed = _pass_cost(target, free, ids, min(round_rows, TIMED_ROUND_ROWS))
    finally:
        for seq_id in range(target.n_seq):
            target.remove(seq_id, -1)
    return replace(report, pass_cost_rows=cost_rows, pass_s=timed)


def _pass_cost(
    target: ProbeTarget, shapes: PassShapes, ids: Sequence[int], round_rows: int
) -> tuple[float, tuple[tuple[int, float], ...]]:
    """How many rows one pass costs (the planner's trade between padding rows and more
    passes), from the least of a few timed tries of one round alone and of every
    sequence's; and the passes timed, (rows, seconds): a lone row, a lone round, every
    sequence's round (the advised draft length's curve starts from them: advice.py)."""
    shapes = replace(shapes, pass_cost_rows=float(shapes.max_rows))  # every round in one pass
    rounds = [
        JobRows(s, PROBE_CONTEXT, round_tokens(ids, s, round_rows), True)
        for s in range(target.n_seq)
    ]
    single = JobRows(0, PROBE_CONTEXT, round_tokens(ids, 0, 1), True)

    def timed(jobs: list[JobRows]) -> float:
        best = float("inf")
        for _ in range(TIMED_REPEATS):
            began = time.perf_counter()
            target.decode_jobs(jobs, shapes)
            best = min(best, time.perf_counter() - began)
            for job in jobs:
                target.remove(job.seq_id, PROBE_CONTEXT)
        return best

    one_row, one = timed([single]), timed(rounds[:1])
    alone = ((1, one_row), (round_rows, one))
    if target.n_seq < 2:
        return 0.0, alone
    every = timed(rounds)
    timings = (*alone, (round_rows * target.n_seq, every))
    per_row = (every - one) / (round_rows * (target.n_seq - 1))
    if per_row <= 0:
        return float(round_rows * target.n_seq), timings  # rows cost nothing measurable: fill
    return max(0.0, (one - per_row * round_rows) / per_row), timings
