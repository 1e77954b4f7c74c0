"""One cycle of the engine: what begins, what shares a pass, what is answered.

`CycleStep.step(queued)` takes the jobs waiting now, in arrival order, and returns what
the cycle did: the answer (or error) of each job it finished, the passes it decoded and
what the metrics count. No threads, no asyncio, no futures: for given jobs and an engine
in a given state it does the same thing, and tests drive it with plain inputs. The
concurrency shell around it (scheduler.py) queues requests, runs steps on the engine
thread, and hands the answers to the callers.

A step, in order: calls that need no decode (a DELETE, the end of a /generate) run once
their session's earlier work is done; new jobs begin (a prompt reserves its sequence, a
round is checked, a replayed round is answered from its record); then one decode: every
begun round, shaped into as few passes as the engine can make, each client's draft cut to
its advice while another API key is present (fair_share.py), or one chunk of one prompt,
the prompts taking turns by API key (`PromptTurns`). When rounds and prompts
both wait, steps alternate between them, so a round waits at most about one prompt
chunk, however long the prompts in the queue. (With pinned shapes every pass spans every
sequence anyway: rounds and a chunk of each prompt share it.) A round that asks for a
chunk of the verifier's own tokens stays queued, one single-token round in each step of
rounds, until it has them (chunks.py); it is answered once. If anything fails in a way
the engine could not pin on one job, every job of the step not yet answered is undone
and failed (a chunk with steps done is answered with them): sending it again is safe.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from server.shared.constraint import Constraint
from server.shared.protocol import PrefillRequest, VerifyRequest, VerifyResponse
from server.verifier.decoding.checks import RoundKey, round_key
from server.verifier.decoding.chunks import ChunkSteps
from server.verifier.decoding.decoder import PassRecord
from server.verifier.decoding.engine import Engine
from server.verifier.decoding.jobs import Opened, PrefillWork, VerifyWork, Work
from server.verifier.decoding.rounds import grammar_step, record_answer
from server.verifier.errors import APIError, EngineInterrupted, InternalError, SessionNotFound
from server.verifier.kv.sessions import Session
from server.verifier.scheduling.fair_share import KeysPresent, share_fairly

log = logging.getLogger(__name__)

SessionKey = tuple[str, str]  # (API key, session id)


@dataclass(eq=False)
class Job:
    """A request waiting for the engine."""

    owner: str
    session_id: str | None  # the session it touches (None for a prefill of a new id)
    request: PrefillRequest | VerifyRequest | None = None
    call: Callable[[], object] | None = None  # engine work that needs no decode
    round_key: RoundKey | None = None  # a verify job's, computed once
    work: Work | None = None  # once begun (a chunk: its step now)
    chunk: ChunkSteps | None = None  # a round asking for several tokens: its steps so far
    constraint: Constraint | None = None  # a prefill's grammar state, compiled off-thread
    masks: Pending | None = None  # a round's grammar masks, computed off the engine thread
    masks_for: RoundKey | None = None  # the round key they were computed for
    queued_at: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        request = self.request
        if isinstance(request, VerifyRequest) and (
            (request.chunk_tokens or 1) > 1 or request.draft_accept is not None
        ):  # a lookup the verifier sizes is a chunk's first step
            self.chunk = ChunkSteps(request)

    @property
    def session_key(self) -> SessionKey | None:
        return None if self.session_id is None else (self.owner, self.session_id)


@dataclass
class Step:
    """What one cycle did."""

    answers: list[tuple[Job, object]] = field(default_factory=list)  # a result or an APIError
    passes: list[PassRecord] = field(default_factory=list)
    rounds_decoded: int = 0  # rounds in the cycle's pass of rounds
    answered_rounds: list[SessionKey] = field(default_factory=list)  # decoded and answered
    rounds: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) each
    lookups: list[tuple[int, int]] = field(default_factory=list)  # of those, a client's lookups
    copies: list[tuple[int, int]] = field(default_factory=list)  # chunk steps' own copies, alike
    advised: list[int] = field(default_factory=list)  # the draft length each round's answer advised
    fixed_rows: float = 0.0  # what a pass's fixed part costs, in rows, as learned so far
    ended: list[SessionKey] = field(default_factory=list)  # sessions a call ran for
    replayed: int = 0
    evicted: int = 0
    moved: int = 0
    prompt_tokens_reused: int = 0
    prompt_tokens_evaluated: int = 0
    masks_awaited: int = 0  # rounds left queued for their grammar's masks

    def answer(self, job: Job, result: object) -> None:
        if isinstance(result, Exception) and not isinstance(result, APIError):
            log.error("engine error", exc_info=result)
            result = InternalError(f"{type(result).__name__}: {result}")
        self.answers.append((job, result))


class PromptTurns:
    """Which prompt gets the cycle's chunk: the next key in turn, its oldest prompt. A
    key new to the turns joins at the back, in arrival order."""

    def __init__(self) -> None:
        self._turn: deque[str] = deque()

    def next(self, prompts: Sequence[Job]) -> list[Job]:
        if not prompts:
            return []
        owners = {job.owner for job in prompts}
        for job in prompts:
            if job.owner not in self._turn:
                self._turn.append(job.owner)
        while self._turn[0] not in owners:
            self._turn.rotate(-1)
        owner = self._turn[0]
        self._turn.rotate(-1)
        return [next(job for job in prompts if job.owner == owner)]


class Pending(Protocol):
    """A result on its way (a `concurrent.futures.Future`, or `Ready`)."""

    def done(self) -> bool: ...

    def result(self) -> np.ndarray | None: ...


@dataclass
class Ready:
    """A result there at once."""

    value: np.ndarray | None = None
    error: Exception | None = None

    def done(self) -> bool:
        return True

    def result(self) -> np.ndarray | None:
        if self.error is not None:
            raise self.error
        return self.value


MaskRunner = Callable[[str, Callable[[], np.ndarray]], Pending]


def run_inline(owner: str, fn: Callable[[], np.ndarray]) -> Pending:
    """Masks computed at once, on the caller's thread (tests that run the steps by hand)."""
    try:
        return Ready(fn())
    except Exception as exc:
        return Ready(error=exc)


class CycleStep:
    def __init__(
        self, engine: Engine, masks: MaskRunner = run_inline, present: KeysPresent | None = None
    ):
        """`masks`: where a round's grammar masks are computed (by owner); `present`: the
        API keys seen lately, besides those queued (none where not given)."""
        self.engine = engine
        self.masks = masks
        self.present = present or KeysPresent()
        self.turns = PromptTurns()
        self.prompt_next = False  # the last step decoded rounds while a prompt waited

    def step(self, queued: Sequence[Job]) -> Step:
        """One step over the jobs queued now (none of them answered yet)."""
        out = Step()
        if not queued:
            return out
        decoding = set[str]()  # keys with a round or a prompt begun: decoded, or queued for it
        pinned = bool(self.engine.shapes.pinned_width)
        # A prompt's turn begins no round: a round begun is decoded in the same step, so
        # none is left begun in the engine while its request may go away.
        prompt_turn = self.prompt_next and not pinned and any(_is_prompt(j) for j in queued)
        try:
            rounds, prompts = self._begin_all(queued, out, begin_rounds=not prompt_turn)
            decoding = {job.owner for job in rounds + prompts}
            if pinned:
                self._decode(rounds + prompts, out)
            elif prompt_turn or not rounds:
                self._decode(self.turns.next(prompts), out, interleaved=prompt_turn)
                self.prompt_next = False
            else:
                self._share_fairly(rounds, decoding)
                self._decode(rounds, out)
                self.prompt_next = bool(prompts)
        except Exception as exc:
            log.exception("the engine's cycle failed")
            answered = {id(job) for job, _ in out.answers}
            error = EngineInterrupted(f"the engine's pass failed ({exc}); retry")
            for job in queued:
                if id(job) not in answered:
                    out.answer(job, self.fail(job, error))
        # Only work decoded makes a key present: a refusal, a replay or a round waiting
        # for its masks widens no pass, so sending them cuts no other key's drafts.
        self.present.seen(decoding)
        return out

    def _share_fairly(self, rounds: Sequence[Job], decoding: set[str]) -> None:
        """Each client's draft cut to its session's advice while another API key is
        present: a round or a prompt of it begun now (`decoding`), or one decoded lately
        (fair_share.py). Pinned, every session's rows are decoded anyway: `step` does not
        call this."""
        works = [job.work for job in rounds if isinstance(job.work, VerifyWork)]
        share_fairly(works, self.present.recent() | decoding, self._advice)

    def _advice(self, session: Session) -> int | None:
        engine = self.engine
        return engine.advisor.advise(
            session.acceptance, engine.max_draft, session.last_draft, session.owner
        )

    def fail(self, job: Job, error: Exception) -> VerifyResponse | Exception:
        """Undo a job that will not be finished; what to answer it: `error`, or for a
        chunk with steps committed, those steps (the next round learns what went wrong)."""
        if job.work is not None:
            try:
                self.engine.abandon(job.work)
            except Exception:
                log.exception("could not undo a job")
        return self._chunk_answer(job) if job.chunk is not None and job.chunk.steps else error

    def _chunk_answer(self, job: Job) -> VerifyResponse:
        """A chunk's answer, recorded for a replay of the client's request."""
        assert job.chunk is not None and job.session_id is not None  # a round's chunk
        try:
            session = self.engine.session(job.session_id, job.owner)
        except SessionNotFound:  # ended meanwhile: nothing to replay, nothing to advise
            return job.chunk.answer(None)
        answer = job.chunk.answer(self._advice(session))
        record_answer(session, job.round_key, answer)
        return answer

    def _begin_all(
        self, jobs: Sequence[Job], out: Step, begin_rounds: bool
    ) -> tuple[list[Job], list[Job]]:
        """Calls run, new jobs begun (rounds only if `begin_rounds`), in arrival order;
        the rounds and prompts to decode. A job behind unfinished work of its session
        waits for a later step."""
        rounds, prompts = list[Job](), list[Job]()
        busy: set[str | None] = set()  # sessions with unfinished work earlier in the queue
        keep = {job.session_id for job in jobs if job.session_id}
        for job in jobs:
            if job.work is not None and job.work.closed:
                continue  # finished or undone, so answered already: not the caller's to pass
            waits = job.session_id is not None and job.session_id in busy
            if job.call is not None:
                if not waits:
                    if job.session_key is not None:  # a delete or a /generate's end
                        out.ended.append(job.session_key)
                    self._run_call(job, job.call, out)
                continue
            if waits:
                continue
            ready = _is_prompt(job) or self._masks_ready(job)  # masks start early
            if not (begin_rounds or _is_prompt(job)) or not ready:
                busy.add(job.session_id)  # its round waits: so does what comes after it
                out.masks_awaited += not ready
                continue
            if job.work is None and not self._begin(job, keep, out):
                continue
            assert job.work is not None  # begun
            busy.add(job.work.session.session_id)
            (rounds if isinstance(job.work, VerifyWork) else prompts).append(job)
        return rounds, prompts

    def _run_call(self, job: Job, call: Callable[[], object], out: Step) -> None:
        try:
            result = call()
        except Exception as exc:
            result = exc
        out.answer(job, result)

    def _begin(self, job: Job, keep: set[str], out: Step) -> bool:
        try:
            if isinstance(job.request, PrefillRequest):
                job.work = self.engine.begin_prefill(job.request, keep, job.owner, job.constraint)
                job.session_id = job.work.session.session_id
                out.evicted += job.work.reservation.evicted
                out.moved += job.work.reservation.moved
                return True
            request, key, copy = job.request, job.round_key, None
            assert isinstance(request, VerifyRequest) and job.session_id is not None  # a round
            if job.chunk is not None:
                session = self.engine.session(job.session_id, job.owner)
                first = not job.chunk.steps
                if first and request.draft_accept is not None and session.last_round_key != key:
                    self.engine.check_round(session, request)  # the whole draft, then sized
                sized = self.engine.copier.size_lookup(session, request) if first else None
                # The verifier's own copy where no client's lookup pays.
                copy = None if sized else self.engine.copier.for_step(session, job.chunk.left)
                if not first or copy or sized is not None:
                    request = job.chunk.next_request(copy.tokens if copy else None, sized)
                    # A first step is still the client's round: its key, for a replay.
                    key = round_key(request) if job.chunk.steps else key
            work = self.engine.begin_verify(request, job.owner, key)
            if isinstance(work, VerifyResponse):  # a replay: answered from its record
                out.replayed += 1
                out.answer(job, work)
                return False
            job.work, work.copied, work.advise = work, copy, job.chunk is None
            # A lookup's draft in a chunk's first step is the client's as a round's is.
            work.client_drafted = copy is None and (job.chunk is None or not job.chunk.steps)
            if job.masks is not None and job.masks_for == key:
                work.masks = job.masks.result()  # a grammar that failed: its 400
            return True
        except Exception as exc:
            # Begun, then something failed: its sequence goes back.
            out.answer(job, self.fail(job, exc))
            job.work = None
            return False

    def _masks_ready(self, job: Job) -> bool:
        """A round of a session with a grammar begins once its masks are computed, off
        the engine thread (`self.masks`): a slow grammar holds its own session, never the
        step that answers the others. Masks are computed only for a round that will be
        decoded (not a replay, nor one its checks refuse: begun, it is answered)."""
        if job.work is not None or not isinstance(job.request, VerifyRequest):
            return True
        assert job.session_id is not None  # a round's
        try:
            session = self.engine.session(job.session_id, job.owner)
            if session.constraint is None or session.work is not None:
                return True
            request, key = job.request, job.round_key
            if job.chunk is not None and job.chunk.steps:
                request = job.chunk.next_request()
                key = round_key(request)
            if session.last_round_key == key and session.last_response is not None:
                return True
            self.engine.check_round(session, request)
        except APIError:
            return True
        if job.masks_for != key:
            constraint, draft = session.constraint, list(request.draft_tokens)
            budget = self.engine.grammar_row_s
            job.masks_for = key
            job.masks = self.masks(
                job.owner, lambda: grammar_step(lambda: constraint.row_masks(draft, budget))
            )
        assert job.masks is not None  # computed for `key`, now or before
        return job.masks.done()

    def _decode(self, jobs: list[Job], out: Step, interleaved: bool = False) -> None:
        if not jobs:
            return
        rounds = [job for job in jobs if isinstance(job.work, VerifyWork)]
        prompts = [job for job in jobs if isinstance(job.work, PrefillWork)]
        round_works = [job.work for job in jobs if isinstance(job.work, VerifyWork)]
        prompt_works = [job.work for job in jobs if isinstance(job.work, PrefillWork)]
        ran = self.engine.run(round_works, prompt_works, interleaved=interleaved)
        out.passes += ran.passes
        out.fixed_rows = self.engine.pass_cost.fixed_rows or 0.0
        if rounds:
            out.rounds_decoded = len(rounds)
        for job, result in zip(rounds + prompts, ran.results, strict=True):
            if result is None:
                continue  # a prompt with chunks still to go
            if isinstance(result, VerifyResponse):
                work, accepted = job.work, result.accepted_prefix_len
                assert isinstance(work, VerifyWork) and job.session_id is not None  # a round
                counted = (len(work.draft_tokens), accepted)
                (out.copies if work.copied else out.rounds).append(counted)
                if work.lookup:
                    out.lookups.append(counted)
                if work.copied:
                    self.engine.copier.answered(work.session, work.copied, work.start + 1, accepted)
                if job.chunk is not None:
                    job.chunk.add(result)
                    if not job.chunk.done(self.engine.n_ctx):
                        job.work = None  # stays queued: its next step is in the next pass
                        continue
                    result = self._chunk_answer(job)
                if result.advised_draft is not None:
                    out.advised.append(result.advised_draft)
                out.answered_rounds.append((job.owner, job.session_id))
            elif isinstance(result, APIError) and job.chunk is not None and job.chunk.steps:
                result = self._chunk_answer(job)  # the steps before this one stand
            elif isinstance(result, Opened):
                reused = result.reservation.reused
                out.prompt_tokens_reused += reused
                out.prompt_tokens_evaluated += result.response.prompt_len - 1 - reused
            out.answer(job, result)


def _is_prompt(job: Job) -> bool:
    return isinstance(job.request, PrefillRequest)
