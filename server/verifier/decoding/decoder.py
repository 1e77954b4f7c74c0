"""The verifier's decodes: jobs' rows shaped into passes (server/verifier/decoding/passes.py) and
decoded, padding and filler rows added and taken out again; a pass that fails decoded
again job by job (server/shared/batching.py). The engine runs rounds and prompts
through it, and the startup probe (invariance.py) the very same shapes."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from server.shared.batching import Piece, decode_pieces, forward_passes, together_or_alone
from server.shared.runtime import LlamaRuntime
from server.verifier.decoding.jobs import JobRows
from server.verifier.decoding.passes import PassPlan, PassShapes


@dataclass(frozen=True)
class PassRecord:
    """What one llama_decode was: for the metrics and the gathering policy."""

    kind: str  # "rounds" or "prompt"
    sessions: int  # jobs with rows of their own
    rows: int  # every row decoded
    real_rows: int  # rows of jobs (the rest: padding and fillers)
    forward_passes: int  # what llama.cpp made of it (server/shared/batching.py)
    seconds: float


@dataclass
class Decoded:
    """What a decode of jobs gave: per job, its logits rows (or, tolerated, the exception
    it failed with) and the time of the pass that computed them; every pass it made."""

    outcomes: list[np.ndarray | Exception] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    passes: list[PassRecord] = field(default_factory=list)


class PassDecoder:
    def __init__(self, runtime: LlamaRuntime):
        self.runtime = runtime
        self.n_seq = runtime.n_seq_max
        self.n_batch = runtime.n_batch
        self.n_ctx_per_seq = runtime.n_ctx_per_seq

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return self.runtime.tokenize(text, add_special=add_special)

    def remove(self, seq_id: int, p0: int, p1: int = -1) -> None:
        self.runtime.remove(seq_id, p0, p1)

    def decode(
        self, jobs: Sequence[JobRows], shapes: PassShapes, tolerate: bool = False
    ) -> Decoded:
        """The jobs shaped into passes by `shapes` and decoded: rounds (jobs with logits)
        as the planner says; prompt chunks in passes of their own, or with pinned shapes,
        beside the rounds. A pass that fails is decoded again job by job; `tolerate`: a
        job that fails alone gets its exception in its place (else raised)."""
        by_seq = {job.seq_id: job for job in jobs}
        planned = [j for j in jobs if j.logits or shapes.pinned_width]
        alone = [j for j in jobs if not (j.logits or shapes.pinned_width)]
        plans = shapes.plan({j.seq_id: len(j.tokens) for j in planned})
        plans += [_own_plan(j, shapes) for j in alone]
        outcomes: dict[int, np.ndarray | Exception] = {}
        seconds: dict[int, float] = {}
        passes: list[PassRecord] = []
        for plan in plans:
            members = [by_seq[s] for s in plan.jobs]

            def decode(subset: Sequence[JobRows], plan: PassPlan = plan) -> list[np.ndarray]:
                if len(subset) < len(plan.jobs):  # decoded again alone: its own shape
                    plan = _own_plan(subset[0], shapes)
                rows, record = self._decode_pass(subset, plan)
                passes.append(record)
                seconds.update((job.seq_id, record.seconds) for job in subset)
                return rows

            results: Sequence[np.ndarray | Exception] = (
                together_or_alone(members, decode) if tolerate else decode(members)
            )
            outcomes.update(zip(plan.jobs, results, strict=True))
        return Decoded(
            [outcomes[job.seq_id] for job in jobs],
            [seconds.get(job.seq_id, 0.0) for job in jobs],
            passes,
        )

    def decode_jobs(self, jobs: Sequence[JobRows], shapes: PassShapes) -> list[np.ndarray]:
        """Each job's logits rows (the startup probe); a failure is raised."""
        return [_raised(outcome) for outcome in self.decode(jobs, shapes).outcomes]

    def evaluate_prompt(
        self,
        seq_id: int,
        tokens: Sequence[int],
        start: int,
        chunk: int,
        shapes: PassShapes,
        min_rows: int = 0,
    ) -> None:
        """`tokens` into sequence `seq_id` from `start`, `chunk` at a time, each pass
        padded to `min_rows` (the probe)."""
        for offset in range(0, len(tokens), chunk):
            piece = tokens[offset : offset + chunk]
            self.decode_jobs([JobRows(seq_id, start + offset, piece, False, min_rows)], shapes)

    def _decode_pass(
        self, jobs: Sequence[JobRows], plan: PassPlan
    ) -> tuple[list[np.ndarray], PassRecord]:
        """One llama_decode: the jobs' rows padded to the plan's width, filler rows for the
        plan's other sequences; padding and fillers removed after."""
        by_seq = {job.seq_id: job for job in jobs}
        pad = self.runtime.eos_id
        pieces = []
        for seq_id in range(plan.first, plan.last + 1):
            job = by_seq.get(seq_id)
            if job is None:  # a filler: after whatever the sequence holds, then removed
                start = self.runtime.next_position(seq_id)
                pieces.append(Piece(seq_id, start, [pad] * plan.width, (), 0))
                continue
            tokens = [*job.tokens, *[pad] * (plan.width - len(job.tokens))]
            logits = range(len(job.tokens)) if job.logits else ()
            pieces.append(Piece(seq_id, job.start, tokens, logits, len(job.tokens)))
        began = time.perf_counter()
        rows = decode_pieces(self.runtime, pieces, plan.every_logit)
        seconds = time.perf_counter() - began
        seq_ids = [p.seq_id for p in pieces for _ in p.tokens]
        record = PassRecord(
            kind="rounds" if any(j.logits for j in jobs) else "prompt",
            sessions=len(jobs),
            rows=len(seq_ids),
            real_rows=sum(len(j.tokens) for j in jobs),
            forward_passes=len(forward_passes(seq_ids, self.runtime.n_batch)),
            seconds=seconds,
        )
        return [rows[job.seq_id - plan.first] for job in jobs], record


def _own_plan(job: JobRows, shapes: PassShapes) -> PassPlan:
    """A job's pass on its own: a round as the planner shapes one; a prompt chunk alone,
    as long as it is or padded to its `min_rows` (unless shapes are pinned)."""
    if job.logits or shapes.pinned_width:
        return shapes.plan({job.seq_id: len(job.tokens)})[0]
    return PassPlan(job.seq_id, job.seq_id, max(len(job.tokens), job.min_rows), (job.seq_id,))


def _raised(outcome: np.ndarray | Exception) -> np.ndarray:
    """A job's rows; its failure raised (untolerated, `decode` raised it already)."""
    if isinstance(outcome, Exception):
        raise outcome
    return outcome
