"""Continuous batching: every session's pending work shares one llama_decode.

One thread at a time uses the engine. Requests queue jobs in arrival order; each pass of
the loop takes the queued jobs in that order and decides which share one batch (one KV
sequence per session, at most n_batch tokens: a verify round whole, a prefill in
chunks); the engine decodes it and finishes or undoes each job (`Engine.run_batch`). A
lone request is decoded at once: nobody waits for company. With flash attention on, a
row's logits do not depend on what else is in the batch, so each result is exactly what
it would be alone (the engine checks this at startup: `/info.batch_invariant`).

One round per session at a time: a /verify for a session whose round is queued or being
decoded waits for it. If it is the same round (a duplicate, a retry), it gets that
round's very answer; otherwise it runs after it (and usually gets 409, n_past having
moved). Calls that change the session table (DELETE, expiry, eviction) never touch a
session with work queued ahead of them: a DELETE waits for the session's queued rounds.

A verify round that finds the engine idle and no other round arriving is decoded on the
caller's own thread instead (`inline_rounds`), saving the two thread switches of the
hand-off to the engine thread and back. The engine is still used by one thread at a
time: whoever holds `_engine_lock`. The event loop is blocked for that one round's
decode, which is no longer than the round would wait behind a decode already running;
prefills and batches stay on the engine thread, so a long prompt never stalls /health.
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

from server.checks import round_key
from server.engine import Engine
from server.errors import APIError, EngineInterrupted, InternalError, ServerFull, Unavailable
from server.jobs import PrefillWork, Slot, Work
from server.metrics import VerifierMetrics
from server.protocol import PrefillRequest, PrefillResponse, VerifyRequest, VerifyResponse

log = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 1.0


@dataclass(eq=False)
class _Job:
    future: Future
    session_id: str | None  # the session it touches (None for a new prefill)
    request: Any = None
    owner: str = "anonymous"
    call: Callable[[], Any] | None = None  # engine work that needs no decode
    round_key: tuple | None = None  # a verify job's, computed once
    work: Work | None = None
    queued_at: float = field(default_factory=time.perf_counter)


class RoundAbandoned(Unavailable):
    """The round's request went away before it reached the engine: nothing was done (a
    copy that joined it sends it again)."""

    error_type = "round_abandoned"


async def _result(future: Future) -> Any:
    if future.done():  # an inline round: no trip through the event loop's wake-up pipe
        return future.result()
    # Shielded: a caller that goes away must not cancel work other callers wait for.
    return await asyncio.shield(asyncio.wrap_future(future))


class BatchScheduler:
    def __init__(
        self,
        engine: Engine,
        metrics: VerifierMetrics,
        *,
        max_queue: int,
        session_ttl_s: float,
        inline_rounds: bool = True,
        start: bool = True,
    ):
        """`start=False` runs no engine thread: the caller drives passes with `run_pass`
        (tests that must not depend on how threads are scheduled)."""
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
        # The round in flight per (owner, session): its key and the future of its answer.
        self._rounds: dict[tuple[str, str], tuple[tuple, Future]] = {}
        self._rounds_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="batch-scheduler", daemon=True)
        self._threaded = start
        if start:
            self._thread.start()

    # -- the API the routes use (any thread, any event loop) --------------------------

    async def prefill(self, request: PrefillRequest, owner: str = "anonymous") -> PrefillResponse:
        # A chosen id is known from the start: work queued for it waits behind this.
        job = _Job(Future(), request.session_id, request=request, owner=owner)
        self._enqueue(job)
        return await _result(job.future)

    async def verify(self, request: VerifyRequest, owner: str = "anonymous") -> VerifyResponse:
        key, this_round = (owner, request.session_id), round_key(request)
        while True:
            with self._rounds_lock:
                current = self._rounds.get(key)
                if current is None:
                    future: Future = Future()
                    self._rounds[key] = (this_round, future)
                    future.add_done_callback(lambda done: self._forget_round(key, done))
                    break
            in_flight_key, in_flight = current
            if in_flight_key == this_round:
                self.metrics.joined_rounds.inc()
                return await _result(in_flight)  # the same round: its very answer
            with contextlib.suppress(Exception):
                await _result(in_flight)  # another round of this session: after it
        try:
            if self.inline_rounds:
                response = await self._verify_inline(request, owner, this_round)
                if response is not None:
                    future.set_result(response)
            if not future.done():
                job = _Job(future, request.session_id, request=request, owner=owner)
                job.round_key = this_round
                self._enqueue(job)
        except BaseException as exc:
            if not future.done():  # the callers waiting on this round learn what happened
                if not isinstance(exc, Exception):
                    exc = RoundAbandoned("the request went away before its round ran; resend")
                future.set_exception(exc)
            raise
        return await _result(future)

    async def call(self, fn: Callable[[], Any], session_id: str | None = None) -> Any:
        """Run engine work that needs no decode (delete, detokenize) on the engine thread,
        after any work queued before it for `session_id`."""
        job = _Job(Future(), session_id, call=fn)
        self._enqueue(job)
        return await _result(job.future)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Refuse new work, let the engine thread finish what is queued, then fail (undone)
        whatever is still queued: nobody is left waiting."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                log.error("the engine thread did not finish its work in %.0f s", timeout_s)
        with self._engine_lock:  # waits out a decode still running
            with self._wake:
                left = list(self._queue)
            self._undo_and_fail(left, ServerFull("the verifier is shutting down"))

    def close(self) -> None:
        """Stop, then free the engine: never while a decode is using it."""
        self.stop()
        with self._engine_lock:
            self.engine.close()

    def run_pass(self, sweep: bool = False) -> None:
        """One pass of the engine thread's loop, on the caller's thread."""
        with self._wake:
            jobs = list(self._queue)
        with self._engine_lock:
            self._pass(jobs)
            if sweep:
                self._sweep(force=True)

    def _enqueue(self, job: _Job) -> None:
        with self._wake:
            if self._stopping:
                raise ServerFull("the verifier is shutting down")
            if self._threaded and not self._thread.is_alive():
                raise EngineInterrupted(
                    "the engine thread has stopped; the verifier needs a restart"
                )
            if len(self._queue) >= self.max_queue:
                self.metrics.rejected_full.inc()
                raise ServerFull(
                    f"the queue is full ({self.max_queue} requests waiting); retry shortly"
                )
            self._queue.append(job)
            self.metrics.queue_depth.set(len(self._queue))
            self._wake.notify()

    def _forget_round(self, key: tuple[str, str], future: Future) -> None:
        with self._rounds_lock:
            if self._rounds.get(key, (None, None))[1] is future:
                del self._rounds[key]

    async def _verify_inline(
        self, request: VerifyRequest, owner: str, key: tuple
    ) -> VerifyResponse | None:
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
                return self._verify_now(request, owner, key)
            finally:
                self._engine_lock.release()
        finally:
            self._arriving -= 1

    def _verify_now(self, request: VerifyRequest, owner: str, key: tuple) -> VerifyResponse:
        work = self.engine.begin_verify(request, owner, key)
        if isinstance(work, VerifyResponse):  # a replay: answered without a decode
            return work
        try:
            (outcome,) = self.engine.run_batch(
                [Slot(work, work.remaining)], observe=self.metrics.observe_batch
            )
        except BaseException:
            self.engine.abandon(work)  # run_batch undoes its own failures; this is a bug's
            raise
        if outcome.error is not None:
            raise outcome.error
        self.metrics.inline_rounds.inc()
        return outcome.response

    # -- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                if not self._queue and not self._stopping:
                    self._wake.wait(timeout=SWEEP_INTERVAL_S)
                if self._stopping and not self._queue:
                    return
                jobs = list(self._queue)
            with self._engine_lock:
                self._pass(jobs)
                try:
                    self._sweep()
                except Exception:  # the thread must outlive any bug: requests wait on it
                    log.exception("the idle sweep failed")

    def _pass(self, jobs: list[_Job]) -> None:
        if not jobs:
            return
        try:
            self._step(jobs)
        except Exception as exc:  # never let the loop die: undo and fail what it held
            log.exception("scheduler step failed")
            # Undone, or never begun: sending it again is safe.
            self._undo_and_fail(jobs, EngineInterrupted(f"the engine's pass failed ({exc}); retry"))

    def _undo_and_fail(self, jobs: list[_Job], error: APIError) -> None:
        """Undo every begun job still open, then fail each job not yet answered."""
        for job in jobs:
            if job.work is not None:
                try:
                    self.engine.abandon(job.work)
                except Exception:
                    log.exception("could not undo a job")
            self._fail(job, error)

    def _busy_sessions(self) -> set[str]:
        with self._wake:
            return {job.session_id for job in self._queue if job.session_id}

    def _sweep(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_sweep < SWEEP_INTERVAL_S:
            return
        self._last_sweep = now
        expired = self.engine.expire_idle(self.session_ttl_s, self._busy_sessions())
        if expired:
            log.info("expired %d idle sessions", len(expired))
            self.metrics.expired_sessions.inc(len(expired))
        self.metrics.active_sessions.set(self.engine.session_count)

    def _step(self, jobs: list[_Job]) -> None:
        """Decide one batch from the queue, in arrival order, and run it."""
        budget = self.engine.runtime.n_batch
        prompt_chunk = self.engine.prompt_chunk
        slots: list[tuple[_Job, Slot]] = []
        seq_ids: set[int] = set()
        touched: set[str] = set()  # sessions with work earlier in the queue
        for job in jobs:
            if job.call is not None:
                if job.session_id not in touched:  # else: after that work, in a later pass
                    self._settle(job, job.call)
                continue
            if job.session_id is not None:
                touched.add(job.session_id)
            if budget == 0:
                continue
            if job.work is None and not self._begin(job):
                continue
            work = job.work
            touched.add(work.session.session_id)
            if work.session.seq_id in seq_ids:
                continue  # one slice per session per batch: the next pass takes it
            n_tokens = work.remaining
            prompt = isinstance(work, PrefillWork)
            if prompt:
                # At most prompt_chunk tokens from where evaluation starts, each chunk decoded
                # on its own however busy the engine (llama.cpp would cut a chunk sharing a
                # decode into micro-batches of its batch-mates' length): a cold prompt is
                # always cut at the same places, multiples of prompt_chunk. A reused prefix
                # exists only where the probe found the cuts do not matter (engine.py).
                n_tokens = min(n_tokens, prompt_chunk)
                if slots:
                    budget = 0  # next pass, alone; keep arrival order
                    continue
            if n_tokens > budget:
                budget = 0  # a round is decoded whole; keep arrival order
                continue
            slots.append((job, Slot(work, n_tokens)))
            seq_ids.add(work.session.seq_id)
            budget = 0 if prompt else budget - n_tokens
        if not slots:
            return
        outcomes = self.engine.run_batch(
            [slot for _, slot in slots], observe=self.metrics.observe_batch
        )
        for (job, _), outcome in zip(slots, outcomes, strict=True):
            if outcome.error is not None:
                self._fail(job, outcome.error)
            elif outcome.response is not None:
                if isinstance(outcome.response, PrefillResponse):
                    self._count_prompt(outcome.response)
                self._settle(job, lambda r=outcome.response: r)

    def _count_prompt(self, response: PrefillResponse) -> None:
        self.metrics.prompt_tokens_reused.inc(response.cached_tokens)
        self.metrics.prompt_tokens_evaluated.inc(response.prompt_len - 1 - response.cached_tokens)

    def _begin(self, job: _Job) -> bool:
        try:
            if isinstance(job.request, PrefillRequest):
                evicted = self.engine.evicted_sessions
                job.work = self.engine.begin_prefill(job.request, self._busy_sessions(), job.owner)
                job.session_id = job.work.session.session_id
                self.metrics.evicted_sessions.inc(self.engine.evicted_sessions - evicted)
                return True
            work = self.engine.begin_verify(job.request, job.owner, job.round_key)
            if isinstance(work, VerifyResponse):  # a replay: answered without a decode
                self._settle(job, lambda: work)
                return False
            job.work = work
            return True
        except Exception as exc:
            if job.work is not None:  # begun, then something failed: its sequence goes back
                self.engine.abandon(job.work)
                job.work = None
            self._fail(job, exc)
            return False

    def _settle(self, job: _Job, produce: Callable[[], Any]) -> None:
        try:
            result = produce()
        except Exception as exc:
            self._fail(job, exc)
            return
        self._remove(job)
        if not job.future.done():
            job.future.set_result(result)

    def _fail(self, job: _Job, exc: Exception) -> None:
        self._remove(job)
        if not isinstance(exc, APIError):
            log.error("engine error", exc_info=exc)
            exc = InternalError(f"{type(exc).__name__}: {exc}")
        if not job.future.done():
            job.future.set_exception(exc)

    def _remove(self, job: _Job) -> None:
        with self._wake:
            with contextlib.suppress(ValueError):
                self._queue.remove(job)
            self.metrics.queue_depth.set(len(self._queue))
