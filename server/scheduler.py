"""Continuous batching: every session's pending work shares one llama_decode.

One thread at a time uses the engine. Requests queue jobs in arrival order; each pass of the loop
takes the queued jobs in that order, builds one batch (one KV sequence per session, at
most n_batch tokens: a verify round whole, a prefill in chunks), decodes it once and
hands each job its share. A lone request is decoded at once: nobody waits for company.
With flash attention on, a row's logits do not depend on what else is in the batch, so
each result is exactly what it would be alone.

A verify round that finds the engine idle and no other round arriving is decoded on the
caller's own thread instead (`inline_rounds`): handing it to the engine thread and the
answer back costs two thread switches, about 0.2 ms of a round's protocol overhead here.
The engine is still used by one thread at a time: whoever holds `_engine_lock`. The
event loop is blocked for that one round's decode, which is no longer than the round
would wait behind a decode already running; prefills and batches stay on the engine
thread, so a long prompt never stalls /health.
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
        inline_rounds: bool = True,
    ):
        self.engine = engine
        self.inline_rounds = inline_rounds
        self.metrics = metrics
        self.max_queue = max_queue
        self.session_ttl_s = session_ttl_s
        self._queue: deque[_Job] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._last_sweep = time.monotonic()
        self._engine_lock = threading.Lock()  # held while the engine is in use
        self._arriving = 0  # verify calls deciding between inline and the queue
        self._thread = threading.Thread(target=self._run, name="batch-scheduler", daemon=True)
        self._thread.start()

    # -- the API the routes use (any thread, any event loop) --------------------------

    async def prefill(self, request: PrefillRequest, owner: str = "anonymous") -> PrefillResponse:
        return await self._submit(_Job(Future(), None, request=request, owner=owner))

    async def verify(self, request: VerifyRequest, owner: str = "anonymous") -> VerifyResponse:
        if self.inline_rounds:
            response = await self._verify_inline(request, owner)
            if response is not None:
                return response
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

    async def _verify_inline(self, request: VerifyRequest, owner: str) -> VerifyResponse | None:
        """The round decoded here and now, or None when it must take the queue: other
        work is queued or running, or other rounds arrived with it (they batch)."""
        self._arriving += 1
        try:
            if self.engine.session_count > 1:
                # Requests read in the same pass of the event loop are already scheduled:
                # let them reach this point, so that a burst is batched, not run one by one.
                await asyncio.sleep(0)
            if self._arriving > 1 or self._queue or self._stopping:
                return None
            if not self._engine_lock.acquire(blocking=False):
                return None
            try:
                return self._verify_now(request, owner)
            finally:
                self._engine_lock.release()
        finally:
            self._arriving -= 1

    def _verify_now(self, request: VerifyRequest, owner: str) -> VerifyResponse:
        work = self.engine.begin_verify(request, owner)
        if isinstance(work, VerifyResponse):  # a replay: answered without a decode
            return work
        try:
            logits, decode_s = self._timed_decode(1, work.entries)
        except DecodeError as exc:
            self.engine.abort_verify(work)
            raise EngineFailure(f"decode failed: {exc}") from exc
        except Exception:
            self.engine.abort_verify(work)
            raise
        self.metrics.inline_rounds.inc()
        return self.engine.finish_verify(work, logits, decode_s * 1000.0)

    # -- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                if not self._queue and not self._stopping:
                    self._wake.wait(timeout=1.0)
                if self._stopping and not self._queue:
                    return
                jobs = list(self._queue)
            with self._engine_lock:
                if jobs:
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
        try:
            logits, decode_s = self._timed_decode(len(in_batch), entries)
        except DecodeError as exc:
            for job, _ in in_batch:
                if isinstance(job.work, VerifyWork):
                    self.engine.abort_verify(job.work)
                else:
                    self.engine.abort_prefill(job.work)
                self._fail(job, EngineFailure(f"decode failed: {exc}"))
            return
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

    def _timed_decode(self, n_sessions: int, entries: list[BatchEntry]) -> tuple[Any, float]:
        if not entries:
            return None, 0.0
        began = time.perf_counter()
        logits = self.engine.runtime.decode(entries)
        decode_s = time.perf_counter() - began
        self.metrics.observe_batch(n_sessions, len(entries), decode_s)
        return logits, decode_s

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
