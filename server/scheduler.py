"""Continuous batching: every session's pending work shares one llama_decode.

One thread owns the engine. Requests queue jobs in arrival order; each pass of the loop
takes the queued jobs in that order, builds one batch (one KV sequence per session, at
most n_batch tokens: a verify round whole, a prefill in chunks), decodes it once and
hands each job its share. A lone request is decoded at once: nobody waits for company.
With flash attention on, a row's logits do not depend on what else is in the batch, so
each result is exactly what it would be alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from server.engine import Engine, PrefillWork, VerifyWork
from server.errors import APIError, EngineFailure, ServerFull
from server.metrics import VerifierMetrics
from server.protocol import PrefillRequest, PrefillResponse, VerifyRequest, VerifyResponse
from server.runtime import BatchEntry, DecodeError

log = logging.getLogger(__name__)


@dataclass
class _Job:
    future: Future
    session_id: str | None  # the session it touches (None for a new prefill)
    request: Any = None
    owner: str = "anonymous"
    call: Callable[[], Any] | None = None  # engine work that needs no decode
    work: PrefillWork | VerifyWork | None = None
    queued_at: float = field(default_factory=time.perf_counter)


class BatchScheduler:
    def __init__(
        self,
        engine: Engine,
        metrics: VerifierMetrics,
        *,
        max_queue: int,
        session_ttl_s: float,
    ):
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.session_ttl_s = session_ttl_s
        self._queue: deque[_Job] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._last_sweep = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="batch-scheduler", daemon=True)
        self._thread.start()

    # -- the API the routes use (any thread, any event loop) --------------------------

    async def prefill(self, request: PrefillRequest, owner: str = "anonymous") -> PrefillResponse:
        return await self._submit(_Job(Future(), None, request=request, owner=owner))

    async def verify(self, request: VerifyRequest, owner: str = "anonymous") -> VerifyResponse:
        return await self._submit(_Job(Future(), request.session_id, request=request, owner=owner))

    async def call(self, fn: Callable[[], Any], session_id: str | None = None) -> Any:
        """Run engine work that needs no decode (delete, detokenize) on the engine thread."""
        return await self._submit(_Job(Future(), session_id, call=fn))

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=30)

    async def _submit(self, job: _Job) -> Any:
        with self._wake:
            if self._stopping:
                raise ServerFull("the verifier is shutting down")
            if len(self._queue) >= self.max_queue:
                self.metrics.rejected_full.inc()
                raise ServerFull(
                    f"the queue is full ({self.max_queue} requests waiting); retry shortly"
                )
            self._queue.append(job)
            self.metrics.queue_depth.set(len(self._queue))
            self._wake.notify()
        return await asyncio.wrap_future(job.future)

    # -- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._stopping:
                    self._wake.wait(timeout=1.0)
                    self._sweep()
                if self._stopping and not self._queue:
                    return
                jobs = list(self._queue)
            try:
                self._step(jobs)
            except Exception as exc:  # never let the loop die: fail what it held
                log.exception("scheduler step failed")
                for job in jobs:
                    self._fail(job, EngineFailure(f"internal error: {exc}"))
            self._sweep()

    def _busy_sessions(self) -> set[str]:
        with self._wake:
            return {job.session_id for job in self._queue if job.session_id}

    def _sweep(self) -> None:
        now = time.monotonic()
        if now - self._last_sweep < 1.0:
            return
        self._last_sweep = now
        expired = self.engine.expire_idle(self.session_ttl_s, self._busy_sessions())
        if expired:
            log.info("expired %d idle sessions", len(expired))
            self.metrics.expired_sessions.inc(len(expired))
        self.metrics.active_sessions.set(self.engine.session_count)

    def _step(self, jobs: list[_Job]) -> None:
        budget = self.engine.runtime.n_batch
        in_batch: list[tuple[_Job, list[BatchEntry]]] = []
        seq_ids: set[int] = set()
        for job in jobs:
            if job.call is not None:
                self._finish(job, job.call)
                continue
            if budget == 0:
                break
            if job.work is None and not self._begin(job):
                continue
            session = job.work.session
            if session.seq_id in seq_ids:
                continue  # one slice per session per batch: the next pass takes it
            if isinstance(job.work, VerifyWork):
                entries = job.work.entries
                if len(entries) > budget:
                    break  # a round is decoded whole; keep arrival order
            else:
                entries = self.engine.prefill_entries(job.work, budget)
            in_batch.append((job, entries))
            seq_ids.add(session.seq_id)
            budget -= len(entries)
        if in_batch:
            self._decode(in_batch)

    def _begin(self, job: _Job) -> bool:
        try:
            if isinstance(job.request, PrefillRequest):
                job.work = self.engine.begin_prefill(job.request, self._busy_sessions(), job.owner)
                job.session_id = job.work.session.session_id
                return True
            work = self.engine.begin_verify(job.request, job.owner)
            if isinstance(work, VerifyResponse):  # a replay: answered without a decode
                self._finish(job, lambda: work)
                return False
            job.work = work
            return True
        except Exception as exc:
            self._fail(job, exc)
            return False

    def _decode(self, in_batch: list[tuple[_Job, list[BatchEntry]]]) -> None:
        entries = [entry for _, slice_ in in_batch for entry in slice_]
        began = time.perf_counter()
        try:
            logits = self.engine.runtime.decode(entries) if entries else None
        except DecodeError as exc:
            for job, _ in in_batch:
                if isinstance(job.work, VerifyWork):
                    self.engine.abort_verify(job.work)
                else:
                    self.engine.abort_prefill(job.work)
                self._fail(job, EngineFailure(f"decode failed: {exc}"))
            return
        decode_s = time.perf_counter() - began
        if entries:
            self.metrics.observe_batch(len(in_batch), len(entries), decode_s)
        row = 0
        for job, slice_ in in_batch:
            if isinstance(job.work, VerifyWork):
                n = len(slice_)
                rows = logits[row : row + n]
                row += n
                self._finish(
                    job,
                    lambda w=job.work, r=rows: self.engine.finish_verify(w, r, decode_s * 1000.0),
                )
            else:
                response = self.engine.advance_prefill(job.work, len(slice_))
                if response is not None:
                    self._finish(job, lambda r=response: r)

    def _finish(self, job: _Job, produce: Callable[[], Any]) -> None:
        try:
            result = produce()
        except Exception as exc:
            self._fail(job, exc)
            return
        self._remove(job)
        job.future.set_result(result)

    def _fail(self, job: _Job, exc: Exception) -> None:
        self._remove(job)
        if not isinstance(exc, APIError):
            log.exception("engine error", exc_info=exc)
        if not job.future.done():
            job.future.set_exception(exc)

    def _remove(self, job: _Job) -> None:
        with self._wake:
            with contextlib.suppress(ValueError):
                self._queue.remove(job)
            self.metrics.queue_depth.set(len(self._queue))
