"""Continuous batching: who runs when. The engine (engine.py) decides how.

One thread at a time uses the engine: the engine thread, or, for a lone round that finds
the engine idle, the event loop itself (`inline_rounds`, which saves the round two
thread hand-offs). Requests queue jobs; each cycle takes what is queued, in arrival
order: calls that need no decode (DELETE, detokenize) run once the session's earlier
work is done; new jobs begin (a prompt reserves its sequence, a round is checked, a
replayed round is answered from its record); then every begun round is decoded, shaped
into as few passes as the engine can make, and then one chunk of one prompt, the prompts
taking turns by API key. So a round waits at most about one prompt chunk, however long
the prompts in the queue: a long prompt is interleaved with rounds, never ahead of them.
Before a cycle takes the queue, it may wait, at most a pass's fixed cost, for sessions
the last pass answered that have been coming back quickly (gather.py), so that drafters
share one pass rather than taking turns in groups.

One round per session at a time: a /verify for a session whose round is queued or being
decoded waits for it, then runs; a copy of that same round (a retry) then gets its
recorded answer, and a different one usually 409 (n_past has moved). Calls that change
the session table (DELETE, expiry, eviction) never touch a session with work queued
ahead of them.

The queue is shared fairly: a key may fill at most its part of it (`max_queue` divided
among the keys with work queued, and one more), and a key with nothing queued always gets
in, so however many keys flood it, another key's round is never refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from server.shared.protocol import PrefillRequest, PrefillResponse, VerifyRequest, VerifyResponse
from server.verifier.checks import round_key
from server.verifier.engine import Engine
from server.verifier.errors import (
    APIError,
    EngineInterrupted,
    InternalError,
    ServerFull,
    Unavailable,
)
from server.verifier.gather import Gatherer
from server.verifier.jobs import PrefillWork, VerifyWork, Work
from server.verifier.metrics import VerifierMetrics

log = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 1.0


@dataclass(eq=False)
class Job:
    """A request waiting for the engine, and the future its caller awaits."""

    future: Future
    owner: str
    session_id: str | None  # the session it touches (None for a prefill of a new id)
    request: PrefillRequest | VerifyRequest | None = None
    call: Callable[[], Any] | None = None  # engine work that needs no decode
    round_key: tuple | None = None  # a verify job's, computed once
    work: Work | None = None  # once begun
    queued_at: float = field(default_factory=time.perf_counter)


class RoundAbandoned(Unavailable):
    """The round's request went away before it reached the engine: nothing was done."""

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
        prefix_ttl_s: float = 600.0,
        inline_rounds: bool = True,
        gather_rounds: bool = True,
        start: bool = True,
    ):
        """`start=False` runs no engine thread: the caller drives cycles with `run_pass`
        (tests that must not depend on how threads are scheduled), and rounds are never
        held for others (`gather_rounds`, server/verifier/gather.py)."""
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.session_ttl_s = session_ttl_s
        self.prefix_ttl_s = prefix_ttl_s
        self.inline_rounds = inline_rounds
        self.gather_rounds = gather_rounds
        self.gatherer = Gatherer(
            engine.shapes.pass_cost_rows, pinned=bool(engine.shapes.pinned_width)
        )
        engine.decoder.observe = self._observe_pass
        self._queue: deque[Job] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._last_sweep = time.monotonic()
        self._engine_lock = threading.Lock()  # held while the engine is in use
        self._arriving = 0  # verify calls deciding between inline and the queue
        # The round in flight per (owner, session id): the future of its answer.
        self._rounds: dict[tuple[str, str], Future] = {}
        self._rounds_lock = threading.Lock()
        self._prompt_turn: deque[str] = deque()  # owners in the order their prompts go
        self._thread = threading.Thread(target=self._run, name="batch-scheduler", daemon=True)
        self._threaded = start
        if start:
            self._thread.start()

    # -- the API the routes use (any thread, any event loop) --------------------------

    async def prefill(self, request: PrefillRequest, owner: str = "anonymous") -> PrefillResponse:
        # A chosen id is known from the start: work queued for it waits behind this.
        job = Job(Future(), owner, request.session_id, request=request)
        self._enqueue(job)
        return await _result(job.future)

    async def verify(
        self, request: VerifyRequest, owner: str = "anonymous", admitted: bool = False
    ) -> VerifyResponse:
        """A round. `admitted`: a later step of a request the queue already let in
        (/generate's rounds), never refused for a full queue: refused, the request would
        fail halfway, its work wasted, whenever another request of its key was queued
        between two of its steps."""
        session_key = (owner, request.session_id)
        while True:
            with self._rounds_lock:
                ahead = self._rounds.get(session_key)
                if ahead is None:
                    future: Future = Future()
                    self._rounds[session_key] = future
                    future.add_done_callback(lambda done: self._forget_round(session_key, done))
                    break
            with contextlib.suppress(Exception):
                await _result(ahead)  # this session's round in flight goes first
        job = Job(future, owner, request.session_id, request=request)
        job.round_key = round_key(request)
        try:
            self._enqueue(job, wake=not self.inline_rounds, admit=not admitted)
            if self.inline_rounds:
                await self._cycle_inline(job)
        except BaseException as exc:
            if not future.done():  # the callers waiting on this round learn what happened
                if not isinstance(exc, Exception):
                    exc = RoundAbandoned("the request went away before its round ran; resend")
                self._remove(job)
                future.set_exception(exc)
            raise
        return await _result(future)

    async def call(
        self,
        fn: Callable[[], Any],
        session_id: str | None = None,
        owner: str = "anonymous",
        finishing: bool = False,
    ) -> Any:
        """Run engine work that needs no decode (delete, detokenize) on the engine thread,
        after any work queued before it for `session_id`. Work `finishing` a request that
        was admitted (its last step, freeing what it leaves) is never refused for a full
        queue: refused, it would waste the request's work or hold a sequence until the
        idle TTL."""
        job = Job(Future(), owner, session_id, call=fn)
        self._enqueue(job, admit=not finishing)
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
        """One cycle of the engine thread's loop, on the caller's thread."""
        with self._wake:
            jobs = list(self._queue)
        with self._engine_lock:
            self._cycle(jobs)
            if sweep:
                self._sweep(force=True)

    # -- queueing -----------------------------------------------------------------------

    def _enqueue(self, job: Job, wake: bool = True, admit: bool = True) -> None:
        with self._wake:
            if self._stopping:
                raise ServerFull("the verifier is shutting down")
            if self._threaded and not self._thread.is_alive():
                raise EngineInterrupted(
                    "the engine thread has stopped; the verifier needs a restart"
                )
            if admit:
                self._admit(job.owner)
            if job.round_key is not None:
                self.gatherer.arrived((job.owner, job.session_id))
            self._queue.append(job)
            self.metrics.queue_depth.set(len(self._queue))
            if wake:
                self._wake.notify()

    def _admit(self, owner: str) -> None:
        """Under the queue's lock: refuse (503) a key that has work queued already when
        the queue is full or the key holds its part of it (the queue divided among the
        keys with work in it and one more). A key with nothing queued always gets in, so
        however many keys flood, another key's round is never refused: the queue goes
        past `max_queue` by at most one request a key."""
        queued = Counter(job.owner for job in self._queue)
        total = len(self._queue)
        others = len(set(queued) - {owner})
        part = max(1, self.max_queue // (others + 2))
        if queued[owner] and (total >= self.max_queue or queued[owner] >= part):
            self.metrics.rejected_full.inc()
            raise ServerFull(
                f"the queue is full ({total} requests waiting, {queued[owner]} of them this "
                "key's); retry shortly"
            )

    def _forget_round(self, session_key: tuple[str, str], future: Future) -> None:
        with self._rounds_lock:
            if self._rounds.get(session_key) is future:
                del self._rounds[session_key]

    def _remove(self, job: Job) -> None:
        with self._wake:
            with contextlib.suppress(ValueError):
                self._queue.remove(job)
            self.metrics.queue_depth.set(len(self._queue))

    async def _cycle_inline(self, job: Job) -> None:
        """Decode the round here and now if it is alone and the engine idle; else hand it
        to the engine thread (rounds arriving together are batched there)."""
        self._arriving += 1
        try:
            if self.engine.session_count > 1:
                # Requests read in the same pass of the event loop are already scheduled:
                # let them reach this point, so that a burst is batched, not run one by one.
                await asyncio.sleep(0)
            alone = self._arriving == 1 and list(self._queue) == [job] and not self._stopping
            if alone and not self._holding() and self._engine_lock.acquire(blocking=False):
                try:
                    self._cycle([job])
                    self.metrics.inline_rounds.inc()
                finally:
                    self._engine_lock.release()
        finally:
            self._arriving -= 1
            if not job.future.done():
                with self._wake:
                    self._wake.notify()

    # -- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                if not self._queue and not self._stopping:
                    self._wake.wait(timeout=SWEEP_INTERVAL_S)
                if self._stopping and not self._queue:
                    return
                self._hold_for_answered()
                jobs = list(self._queue)
            with self._engine_lock:
                self._cycle(jobs)
                try:
                    self._sweep()
                except Exception:  # the thread must outlive any bug: requests wait on it
                    log.exception("the idle sweep failed")

    def _holding(self) -> bool:
        """Whether queued rounds are to wait for sessions the last pass answered."""
        if not (self.gather_rounds and self._threaded):
            return False
        deadline = self.gatherer.deadline()
        return deadline is not None and deadline > self.gatherer.clock()

    def _hold_for_answered(self) -> None:
        """Under the queue's lock: hold the queued rounds until the sessions the last
        pass answered are back, or the gatherer's deadline passes (gather.py)."""
        if not (self.gather_rounds and self._threaded):
            return
        began = time.perf_counter()
        held = False
        while not self._stopping and any(job.round_key is not None for job in self._queue):
            deadline = self.gatherer.deadline()
            if deadline is None:
                break
            left = deadline - self.gatherer.clock()
            if left <= 0:
                self.gatherer.gave_up(held)
                break
            held = True
            self._wake.wait(timeout=left)
        if held:
            seconds = time.perf_counter() - began
            self.gatherer.held(seconds)
            self.metrics.gather_holds.inc()
            self.metrics.gather_hold_seconds.inc(seconds)

    def _observe_pass(self, record) -> None:
        self.metrics.observe_pass(record)
        self.gatherer.observe_pass(record.kind, record.rows, record.seconds)

    def _cycle(self, jobs: Sequence[Job]) -> None:
        if not jobs:
            return
        try:
            rounds, prompts = self._begin_all(jobs)
            if self.engine.shapes.pinned_width:  # every pass spans every sequence anyway
                self._decode(rounds + prompts)
                return
            self._decode(rounds)
            self._decode(self._next_prompt(prompts))
        except Exception as exc:  # never let the loop die: undo and fail what it held
            log.exception("scheduler cycle failed")
            # Undone, or never begun: sending it again is safe.
            self._undo_and_fail(
                [job for job in jobs if not job.future.done()],
                EngineInterrupted(f"the engine's pass failed ({exc}); retry"),
            )

    def _begin_all(self, jobs: Sequence[Job]) -> tuple[list[Job], list[Job]]:
        """Calls run, new jobs begun, in arrival order; the rounds and prompts to decode.
        A job behind unfinished work of its session waits for a later cycle."""
        rounds, prompts = [], []
        busy: set[str] = set()  # sessions with unfinished work earlier in the queue
        for job in jobs:
            if job.future.done():
                continue
            waits = job.session_id is not None and job.session_id in busy
            if job.call is not None:
                if not waits:
                    if job.session_id is not None:  # a delete or a /generate's end
                        self.gatherer.not_coming((job.owner, job.session_id))
                    self._settle(job, job.call)
                continue
            if waits:
                continue
            if job.work is None and not self._begin(job):
                continue
            busy.add(job.work.session.session_id)
            (rounds if isinstance(job.work, VerifyWork) else prompts).append(job)
        return rounds, prompts

    def _next_prompt(self, prompts: list[Job]) -> list[Job]:
        """One prompt for this cycle: the next key in turn, its oldest prompt."""
        if not prompts:
            return []
        owners = {job.owner for job in prompts}
        for job in prompts:  # a key new to the turns joins at the back, in arrival order
            if job.owner not in self._prompt_turn:
                self._prompt_turn.append(job.owner)
        while self._prompt_turn[0] not in owners:
            self._prompt_turn.rotate(-1)
        owner = self._prompt_turn[0]
        self._prompt_turn.rotate(-1)
        return [next(job for job in prompts if job.owner == owner)]

    def _decode(self, jobs: list[Job]) -> None:
        if not jobs:
            return
        rounds = [job for job in jobs if isinstance(job.work, VerifyWork)]
        prompts = [job for job in jobs if isinstance(job.work, PrefillWork)]
        ordered = rounds + prompts
        results = self.engine.run([j.work for j in rounds], [j.work for j in prompts])
        if rounds:  # before any answer goes out: a session may be back at once
            self.metrics.cycle_rounds.observe(len(rounds))
            self.gatherer.answered(
                (job.owner, job.session_id)
                for job, result in zip(ordered, results, strict=False)
                if isinstance(result, VerifyResponse)
            )
        for job, result in zip(ordered, results, strict=True):
            if isinstance(result, APIError):
                self._fail(job, result)
            elif result is not None:
                if isinstance(result, PrefillResponse):
                    self._count_prompt(result)
                self._settle(job, lambda r=result: r)

    def _undo_and_fail(self, jobs: list[Job], error: APIError) -> None:
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
        expired = self.engine.expire_idle(
            self.session_ttl_s, self.prefix_ttl_s, self._busy_sessions()
        )
        if expired:
            log.info("expired %d idle sessions", len(expired))
            self.metrics.expired_sessions.inc(len(expired))
        self.metrics.active_sessions.set(self.engine.session_count)

    def _count_prompt(self, response: PrefillResponse) -> None:
        self.metrics.prompt_tokens_reused.inc(response.cached_tokens)
        self.metrics.prompt_tokens_evaluated.inc(response.prompt_len - 1 - response.cached_tokens)

    def _begin(self, job: Job) -> bool:
        try:
            if isinstance(job.request, PrefillRequest):
                table = self.engine.sessions
                evicted, moved = table.evicted, table.moved
                job.work = self.engine.begin_prefill(job.request, self._busy_sessions(), job.owner)
                job.session_id = job.work.session.session_id
                self.metrics.evicted_sessions.inc(table.evicted - evicted)
                self.metrics.moved_sequences.inc(table.moved - moved)
                return True
            work = self.engine.begin_verify(job.request, job.owner, job.round_key)
            if isinstance(work, VerifyResponse):  # a replay: answered from its record
                self.metrics.replayed_rounds.inc()
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

    def _settle(self, job: Job, produce: Callable[[], Any]) -> None:
        try:
            result = produce()
        except Exception as exc:
            self._fail(job, exc)
            return
        self._remove(job)
        if not job.future.done():
            job.future.set_result(result)

    def _fail(self, job: Job, exc: Exception) -> None:
        self._remove(job)
        if not isinstance(exc, APIError):
            log.error("engine error", exc_info=exc)
            exc = InternalError(f"{type(exc).__name__}: {exc}")
        if not job.future.done():
            job.future.set_exception(exc)
