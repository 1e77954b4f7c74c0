"""The concurrency shell around the cycle step (cycle.py): queueing, the engine thread,
the bridge to asyncio, waking. It holds no policy: admission (admission.py), gathering
(gather.py) and the cycle's choices (cycle.py) decide.

The engine thread alone runs the steps (the tests, with no engine thread started, run
them by hand). Before a step of rounds, it may hold the queued rounds for the sessions
the last pass answered (gather.py).

One round per session at a time: a /verify for a session whose round is queued or being
decoded waits for it, then runs; a copy of that same round (a retry) then gets its
recorded answer, and a different one usually 409 (n_past has moved). Calls that change
the session table (DELETE, expiry, eviction) never touch a session with work queued
ahead of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

from server.shared.protocol import PrefillRequest, VerifyRequest, VerifyResponse
from server.verifier.decoding.checks import round_key
from server.verifier.decoding.engine import Engine
from server.verifier.decoding.jobs import Opened
from server.verifier.errors import EngineInterrupted, ServerFull
from server.verifier.metrics import VerifierMetrics
from server.verifier.scheduling.admission import QueueShare
from server.verifier.scheduling.cycle import CycleStep, Job, Step
from server.verifier.scheduling.fair_share import KeysPresent
from server.verifier.scheduling.gather import Gatherer
from server.verifier.scheduling.keyed_pool import GRAMMAR_NICE, KeyedPool
from server.verifier.settings import VerifierSettings

log = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 1.0
# Threads computing grammar masks, each key's one at a time (keyed_pool.py): a key whose
# grammar is slow holds one, and the engine thread none.
MASK_WORKERS = 2


async def _result(future: Future) -> Any:
    if future.done():  # answered already: no trip through the event loop's wake-up pipe
        return future.result()
    # Shielded: a caller that goes away must not cancel work other callers wait for.
    return await asyncio.shield(asyncio.wrap_future(future))


class RoundsInFlight:
    """One round per session at a time: the future of each (key, session id)'s round."""

    def __init__(self) -> None:
        self._rounds: dict[tuple[str, str], Future] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rounds)

    async def claim(self, session_key: tuple[str, str]) -> Future:
        """The future of this session's next round, once its round in flight is over."""
        while True:
            with self._lock:
                ahead = self._rounds.get(session_key)
                if ahead is None:
                    future: Future = Future()
                    self._rounds[session_key] = future
                    future.add_done_callback(lambda done: self._forget(session_key, done))
                    return future
            with contextlib.suppress(Exception):
                await _result(ahead)  # this session's round in flight goes first

    def _forget(self, session_key: tuple[str, str], future: Future) -> None:
        with self._lock:
            if self._rounds.get(session_key) is future:
                del self._rounds[session_key]


class BatchScheduler:
    def __init__(self, engine: Engine, metrics: VerifierMetrics, settings: VerifierSettings):
        """No engine thread runs until `start`; until then the caller runs the steps
        (`run_step`), and rounds are never held for others."""
        self.engine = engine
        self.metrics = metrics
        self.settings = settings
        self.mask_pool = KeyedPool(MASK_WORKERS, "masks", per_owner=0, nice=GRAMMAR_NICE)
        self.cycle = CycleStep(engine, self._masks, KeysPresent(settings.key_present_s))
        self.admission = QueueShare(settings.max_queue)
        self.gatherer = Gatherer(
            engine.shapes.pass_cost_rows, pinned=bool(engine.shapes.pinned_width)
        )
        self._queue: deque[Job] = deque()
        self._futures: dict[Job, Future] = {}
        self._wake = threading.Condition()
        self._stopping = False
        self._events = 0  # jobs queued and masks computed: what a stalled step waits for
        self._stalled_at = -1  # the events a step that could do nothing had seen
        self._last_sweep = time.monotonic()
        self._engine_lock = threading.Lock()  # held while the engine is in use
        self._rounds = RoundsInFlight()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- the API the service uses (any thread, any event loop) -------------------------

    async def prefill(
        self, request: PrefillRequest, owner: str = "anonymous", constraint: Any = None
    ) -> Opened:
        """`constraint`: the request's grammar state, compiled off the engine thread."""
        # A chosen id is known from the start: work queued for it waits behind this.
        job = Job(owner, request.session_id, request=request, constraint=constraint)
        return await _result(self._enqueue(job))

    async def verify(
        self, request: VerifyRequest, owner: str = "anonymous", admitted: bool = False
    ) -> VerifyResponse:
        """A round. `admitted`: a later step of a request the queue already let in
        (/generate's rounds), never refused for a full queue: refused, the request would
        fail halfway, its work wasted, whenever another request of its key was queued
        between two of its steps."""
        future = await self._rounds.claim((owner, request.session_id))
        job = Job(owner, request.session_id, request=request, round_key=round_key(request))
        try:
            self._enqueue(job, future, admit=not admitted)
        except Exception as exc:
            future.set_exception(exc)  # the callers waiting on this round learn why
            raise
        return await _result(future)

    async def end(self, session_id: str, owner: str, only: object | None = None) -> None:
        """End a session on the engine thread, after the work queued for it. `only` None:
        a client's delete (SessionNotFound where the owner has no such session). Else the
        end of the session a request opened, if it is still that very one and idle; never
        refused for a full queue: refused, it would hold a sequence until the idle TTL."""
        sessions = self.engine.sessions
        end: Callable[[], object]
        if only is None:
            end = functools.partial(sessions.delete, session_id, owner)
        else:
            end = functools.partial(sessions.discard, session_id, only=only)
        await _result(self._enqueue(Job(owner, session_id, call=end), admit=only is None))

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
            for job in self._queued():
                self._answer(job, self.cycle.fail(job, ServerFull("the verifier is shutting down")))

    def close(self) -> None:
        """Stop, then free the engine: never while a decode is using it."""
        self.stop()
        self.mask_pool.shutdown()
        with self._engine_lock:
            self.engine.close()

    def run_step(self) -> Step:
        """One step, on the caller's thread: the engine thread's, or a test's that runs
        no engine thread."""
        with self._engine_lock:
            return self._step(self._queued())

    def run_idle_work(self) -> int:
        """Idle work, on the caller's thread: one cached prefix evaluated again in tiled
        passes (Engine.retile); the tokens evaluated."""
        with self._engine_lock:
            try:
                tokens = self.engine.retile()
            except Exception:  # the thread must outlive any bug: requests wait on it
                log.exception("idle work failed")
                return 0
        self.metrics.prompt_tokens_retiled.inc(tokens)
        return tokens

    def sweep(self) -> None:
        """End idle sessions and prefixes past their TTLs, never one with work queued."""
        busy = {job.session_id for job in self._queued() if job.session_id}
        expired = self.engine.sessions.expire(
            self.settings.session_ttl_s, self.settings.prefix_ttl_s, busy
        )
        if expired:
            log.info("expired %d idle sessions", len(expired))
            self.metrics.expired_sessions.inc(len(expired))
        self.metrics.active_sessions.set(self.engine.session_count)

    # -- queueing -----------------------------------------------------------------------

    def _enqueue(self, job: Job, future: Future | None = None, admit: bool = True) -> Future:
        future = future or Future()
        with self._wake:
            if self._stopping:
                raise ServerFull("the verifier is shutting down")
            if self._thread.ident is not None and not self._thread.is_alive():
                raise EngineInterrupted(
                    "the engine thread has stopped; the verifier needs a restart"
                )
            refusal = self.admission.refusal((j.owner for j in self._queue), job.owner)
            if admit and refusal:
                self.metrics.rejected_full.inc()
                raise ServerFull(refusal)
            if job.round_key is not None:
                assert job.session_id is not None  # a round's
                self.gatherer.arrived((job.owner, job.session_id))
            self._futures[job] = future
            self._queue.append(job)
            self._events += 1
            self.metrics.queue_depth.set(len(self._queue))
            self._wake.notify()
        return future

    def _remove(self, job: Job) -> Future | None:
        with self._wake:
            with contextlib.suppress(ValueError):
                self._queue.remove(job)
            self.metrics.queue_depth.set(len(self._queue))
            return self._futures.pop(job, None)

    # -- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        idle_work = False  # a step ran (or idle work did) since idle work was last found none
        while True:
            idle = False
            with self._wake:
                if self._stalled_at == self._events and not self._stopping:
                    self._wake.wait(timeout=SWEEP_INTERVAL_S)  # rounds wait for their masks
                events = self._events
                if not self._queue and not self._stopping:
                    # Idle work waits a while after the last step: a session's next round
                    # comes sooner, a client's next prompt later.
                    after = self.settings.idle_retile_after_s
                    idle_work = idle_work and after > 0
                    self._wake.wait(timeout=after if idle_work else SWEEP_INTERVAL_S)
                    idle = idle_work and not self._queue and not self._stopping
                if self._stopping and not self._queue:
                    return
                if not idle:
                    self._hold_for_answered()
            if idle:
                idle_work = self.run_idle_work() > 0
            else:
                step = self.run_step()
                stalled = step.masks_awaited and not step.answers and not step.passes
                self._stalled_at = events if stalled else -1
                idle_work = True
            if time.monotonic() - self._last_sweep >= SWEEP_INTERVAL_S:
                self._last_sweep = time.monotonic()
                try:
                    with self._engine_lock:
                        self.sweep()
                except Exception:  # the thread must outlive any bug: requests wait on it
                    log.exception("the idle sweep failed")

    def _hold_for_answered(self) -> None:
        """Under the queue's lock: before a step of rounds, hold the queued rounds for the
        sessions the last pass answered, as long as the gatherer says."""
        if not self.settings.gather_rounds or self.cycle.prompt_next:
            return
        seconds = self.gatherer.hold(
            self._wake,
            waiting=lambda: (
                not self._stopping and any(job.round_key is not None for job in self._queue)
            ),
        )
        if seconds is not None:
            self.metrics.gather_holds.inc()
            self.metrics.gather_hold_seconds.inc(seconds)

    def _queued(self) -> list[Job]:
        """The jobs queued now, taken under the engine lock (by the step that runs them)."""
        with self._wake:
            return list(self._queue)

    def _step(self, jobs: list[Job]) -> Step:
        step = self.cycle.step(jobs)
        try:
            self._record(step)
        except Exception:  # metrics never cost a round its answer
            log.exception("could not record a step")
        for job, result in step.answers:
            self._answer(job, result)
        return step

    def _masks(self, owner: str, fn: Callable[[], Any]) -> Future:
        """A round's masks computed in the mask pool; the engine thread woken when done."""
        future = self.mask_pool.submit(owner, fn)
        future.add_done_callback(self._mask_done)
        return future

    def _mask_done(self, _: Future) -> None:
        with self._wake:
            self._events += 1
            self._wake.notify()

    def _record(self, step: Step) -> None:
        """What the step tells the gatherer and the metrics, before any answer goes out:
        a session may be back at once, and whoever reads the metrics after an answer
        finds its step counted."""
        for record in step.passes:
            self.gatherer.observe_pass(record.kind, record.rows, record.seconds)
        for key in step.ended:
            self.gatherer.not_coming(key)
        if step.rounds_decoded:
            self.gatherer.answered(step.answered_rounds)
        self.metrics.observe_step(step)

    def _answer(self, job: Job, result: Any) -> None:
        future = self._remove(job)
        if future is None:
            return  # its caller went away and answered it already
        with contextlib.suppress(InvalidStateError):
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
