"""The verifier's sessions and rounds on top of one llama.cpp context.

Each session is one KV sequence (seq_id). Its committed tokens are `tokens`; all but the
last are in the KV cache, and the last one (the pending token) is evaluated at the start
of the next round together with the draft, so a round costs one decode of k+1 tokens
whatever the context length.

A job's life is: `begin_prefill` / `begin_verify` (checks, a sequence reserved or the
session marked busy), then `run_batch` (build one batch, decode it, finish each job; on
any failure undo exactly that job's cells and state), or `abandon` if it will never run.
The scheduler only decides which jobs share a batch.

Not thread-safe: the app calls it only under the batch scheduler's engine lock
(server/scheduler.py), from its thread or, for a lone round, from the event loop.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from server import invariance
from server.acceptance import (
    Verdict,
    accept_greedy,
    accept_match,
    accept_rejection,
    accept_threshold,
)
from server.errors import (
    APIError,
    ContextOverflow,
    DecodeFailed,
    DraftTooLong,
    EmptyPrompt,
    InternalError,
    InvalidDraftProbs,
    InvalidToken,
    NPastMismatch,
    SessionBusy,
    UnsupportedSampling,
)
from server.protocol import (
    LOSSLESS,
    InfoResponse,
    PrefillRequest,
    PrefillResponse,
    PromptInput,
    RoundTimings,
    Strategy,
    VerifyRequest,
    VerifyResponse,
    vocab_fingerprint,
)
from server.runtime import BatchEntry, DecodeError, LlamaRuntime
from server.sampling import dense, probabilities
from server.sessions import Session, SessionTable

log = logging.getLogger(__name__)

# How far a row of draft_probs may sum from 1 (the drafter sends float32-derived values).
PROBS_SUM_TOLERANCE = 1e-3

# Called after each llama_decode with (sessions, tokens, seconds): the scheduler's metrics.
DecodeObserver = Callable[[int, int, float], None]


@dataclass(eq=False)
class PrefillWork:
    session: Session
    to_evaluate: list[int]  # the prompt but its last token (that one is the pending token)
    evaluated: int = 0
    closed: bool = False  # finished or undone: nothing of it is left to run

    @property
    def remaining(self) -> int:
        return len(self.to_evaluate) - self.evaluated


@dataclass(eq=False)
class VerifyWork:
    session: Session
    draft_tokens: list[int]
    draft_probs: list[np.ndarray] | None
    start: int  # position of the pending token
    round_key: tuple
    began: float = field(default_factory=time.perf_counter)
    closed: bool = False

    @property
    def remaining(self) -> int:
        return len(self.draft_tokens) + 1  # a round is decoded whole


Work = PrefillWork | VerifyWork


@dataclass(frozen=True)
class Slot:
    """A job's share of one batch: a whole round, or a chunk of a prompt."""

    work: Work
    n_tokens: int


@dataclass(frozen=True)
class Outcome:
    work: Work
    response: PrefillResponse | VerifyResponse | None = None  # None: a prompt not done yet
    error: APIError | None = None


def round_key(request: VerifyRequest) -> tuple:
    """What makes two /verify requests the same round."""
    probs = None
    if request.draft_probs:  # an empty list says what no list says
        probs = tuple(tuple(map(tuple, row)) for row in request.draft_probs)
    return (request.n_past, tuple(request.draft_tokens), probs)


def resolve_strategy(request: PrefillRequest) -> Strategy:
    """The session's verification strategy: asked for, or the natural one."""
    greedy = request.sampling.greedy
    strategy = request.strategy or ("greedy" if greedy else "rejection")
    if strategy == "greedy" and not greedy:
        raise UnsupportedSampling("strategy 'greedy' needs temperature 0")
    if strategy != "greedy" and greedy:
        raise UnsupportedSampling(f"strategy '{strategy}' needs a temperature above 0")
    if strategy == "threshold" and request.threshold is None:
        raise UnsupportedSampling("strategy 'threshold' needs a threshold in (0, 1]")
    return strategy


class Engine:
    def __init__(self, runtime: LlamaRuntime, *, max_draft: int, model_name: str | None = None):
        if runtime.n_batch < max_draft + 1:
            raise ValueError(f"n_batch={runtime.n_batch} cannot hold a draft of {max_draft} + 1")
        self.runtime = runtime
        self.max_draft = max_draft
        self.max_sessions = runtime.n_seq_max
        self.n_ctx = runtime.n_ctx_per_seq
        self.model_name = model_name or runtime.metadata("general.name") or runtime.model_path.stem
        self.vocab_hash = vocab_fingerprint(runtime.vocab_pieces())
        # Before any session exists: the probe borrows the first two sequences.
        self.invariance = invariance.probe(runtime, 0, 1 if runtime.n_seq_max > 1 else None)
        if not self.invariance.batch_invariant:
            log.warning(
                "this build is NOT batch-invariant on this device: logits differ by up to %g "
                "between batch shapes, so greedy output can differ from decoding one token "
                "at a time; greedy sessions report lossless=false",
                self.invariance.max_abs_diff,
            )
        self.sessions = SessionTable(self.max_sessions, runtime.clear)

    # -- facts ------------------------------------------------------------------------

    def lossless(self, strategy: Strategy) -> bool:
        """Greedy is token for token the verifier's own only on a batch-invariant build."""
        if strategy == "greedy":
            return self.invariance.batch_invariant
        return LOSSLESS[strategy]

    def info(self) -> InfoResponse:
        rt = self.runtime
        return InfoResponse(
            model=self.model_name,
            model_path=str(rt.model_path),
            quantization=rt.quantization,
            n_vocab=rt.n_vocab,
            n_ctx=self.n_ctx,
            bos_id=rt.bos_id,
            eos_id=rt.eos_id,
            add_bos=rt.add_bos,
            vocab_hash=self.vocab_hash,
            max_draft=self.max_draft,
            max_sessions=self.max_sessions,
            flash_attn=rt.flash_attn,
            batch_invariant=self.invariance.batch_invariant,
            batch_max_diff=self.invariance.max_abs_diff,
            strategies={s: self.lossless(s) for s in LOSSLESS},
        )

    @property
    def session_count(self) -> int:
        return len(self.sessions)

    def session(self, session_id: str, owner: str | None = None) -> Session:
        return self.sessions.get(session_id, owner)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.runtime.detokenize(tokens)

    def prompt_ids(self, request: PromptInput) -> list[int]:
        if request.prompt is not None:
            ids = self.runtime.tokenize(request.prompt, add_special=request.add_bos)
        else:
            ids = list(request.prompt_tokens or [])
            self._check_token_ids(ids, "prompt_tokens")
        if not ids:
            raise EmptyPrompt("the prompt is empty: give some text or add_bos=true")
        if len(ids) >= self.n_ctx:
            raise ContextOverflow(
                f"the prompt has {len(ids)} tokens; a session's context holds {self.n_ctx} "
                "and needs room for at least one new token"
            )
        return ids

    # -- beginning work ---------------------------------------------------------------

    def begin_prefill(
        self, request: PrefillRequest, keep: Iterable[str] = (), owner: str = "anonymous"
    ) -> PrefillWork:
        """Validate and reserve a KV sequence; sessions in `keep` (work queued) are never
        evicted to make room."""
        strategy = resolve_strategy(request)
        prompt_ids = self.prompt_ids(request)
        seq_id = self.sessions.reserve(keep)
        session = Session(
            session_id=uuid.uuid4().hex,
            seq_id=seq_id,
            tokens=list(prompt_ids),
            prompt_len=len(prompt_ids),
            sampling=request.sampling,
            strategy=strategy,
            threshold=request.threshold,
            rng=np.random.default_rng(request.sampling.seed),
            owner=owner,
        )
        return PrefillWork(session=session, to_evaluate=prompt_ids[:-1])

    def begin_verify(
        self, request: VerifyRequest, owner: str | None = None
    ) -> VerifyWork | VerifyResponse:
        """The round's work, or, for a replay of the last round, its recorded answer."""
        began = time.perf_counter()  # engine_ms counts the checks too
        session = self.session(request.session_id, owner)
        key = round_key(request)
        if session.last_round_key == key and session.last_response is not None:
            return session.last_response
        if session.work is not None:
            raise SessionBusy(f"session {request.session_id!r} has a round in progress")
        draft_tokens = list(request.draft_tokens)
        self._check_round(session, request.n_past, draft_tokens)
        self._check_draft_probs(draft_tokens, request.draft_probs)
        draft_probs = None
        if session.strategy == "rejection" and draft_tokens:
            if request.draft_probs is None:
                raise InvalidDraftProbs(
                    "strategy 'rejection' needs draft_probs (the drafter's q per draft token); "
                    "use strategy 'match' to send tokens only"
                )
            n_vocab = self.runtime.n_vocab
            draft_probs = [(q := dense(row, n_vocab)) / q.sum() for row in request.draft_probs]
        work = VerifyWork(session, draft_tokens, draft_probs, session.n_cached, key, began)
        session.work = work
        return work

    # -- one batch, end to end --------------------------------------------------------

    def run_batch(
        self, slots: Sequence[Slot], observe: DecodeObserver | None = None
    ) -> list[Outcome]:
        """Decode `slots` in one llama_decode and finish each job. When the decode fails,
        every job's cells are removed and each is decoded alone, so only a job that
        cannot be decoded fails. A job that fails is undone: its session is as before its
        round (or, for a prompt, its sequence is free again)."""
        self._check_slots(slots)
        entries = [entry for slot in slots for entry in self._entries(slot)]
        try:
            began = time.perf_counter()
            logits = self.runtime.decode(entries)
            decode_s = time.perf_counter() - began
        except Exception as exc:
            for slot in slots:
                self._remove_cells(slot.work)
            if len(slots) > 1:
                log.warning(
                    "a batch of %d jobs failed (%s): decoding them one by one", len(slots), exc
                )
                return [outcome for slot in slots for outcome in self.run_batch([slot], observe)]
            return [self._fail(slots[0].work, exc)]
        if entries and observe is not None:
            try:
                observe(len(slots), len(entries), decode_s)
            except Exception:  # metrics never cost a round its answer
                log.exception("could not record a decode")
        outcomes, row = [], 0
        for slot in slots:
            try:
                if isinstance(slot.work, VerifyWork):
                    rows = logits[row : row + slot.n_tokens]
                    row += slot.n_tokens
                    outcomes.append(self._finish_verify(slot.work, rows, decode_s))
                else:
                    outcomes.append(self._advance_prefill(slot.work, slot.n_tokens))
            except Exception as exc:
                outcomes.append(self._fail(slot.work, exc))
        return outcomes

    def abandon(self, work: Work) -> None:
        """Undo a begun job that will never run (the scheduler failed it or is stopping)."""
        if not work.closed:
            self._fail(work, InternalError("abandoned"))

    # -- the session table ------------------------------------------------------------

    def expire_idle(self, ttl_s: float, keep: Iterable[str] = ()) -> list[str]:
        """End sessions unused for `ttl_s` seconds, never one with work; returns their ids."""
        return self.sessions.expire(ttl_s, keep)

    def delete_session(self, session_id: str, owner: str | None = None) -> None:
        self.sessions.delete(session_id, owner)

    def discard_session(self, session_id: str) -> None:
        """End a session if it still exists (cleanup paths, where eviction may have won)."""
        self.sessions.discard(session_id)

    @property
    def evicted_sessions(self) -> int:
        return self.sessions.evicted

    def check_invariants(self) -> None:
        self.sessions.check()

    def close(self) -> None:
        self.sessions.release_all()
        self.runtime.close()

    # -- internals --------------------------------------------------------------------

    def _check_slots(self, slots: Sequence[Slot]) -> None:
        """What the scheduler must never send; refused before anything is touched."""
        seq_ids = [slot.work.session.seq_id for slot in slots]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"two jobs of one sequence in a batch: {seq_ids}")
        for slot in slots:
            work = slot.work
            if work.closed or (isinstance(work, VerifyWork) and work.session.work is not work):
                raise ValueError("a batch slot holds a job that is not open")
            if isinstance(work, VerifyWork) and slot.n_tokens != work.remaining:
                raise ValueError("a round is decoded whole")
            if isinstance(work, PrefillWork) and not 0 <= slot.n_tokens <= work.remaining:
                raise ValueError(f"a prompt chunk of {slot.n_tokens} of {work.remaining} tokens")
        if sum(slot.n_tokens for slot in slots) > self.runtime.n_batch:
            raise ValueError(f"the batch exceeds n_batch={self.runtime.n_batch}")

    def _entries(self, slot: Slot) -> list[BatchEntry]:
        work = slot.work
        seq_id = work.session.seq_id
        if isinstance(work, VerifyWork):
            tokens = [work.session.tokens[-1], *work.draft_tokens]
            return [BatchEntry(t, work.start + i, seq_id, True) for i, t in enumerate(tokens)]
        chunk = work.to_evaluate[work.evaluated : work.evaluated + slot.n_tokens]
        return [BatchEntry(t, work.evaluated + i, seq_id, False) for i, t in enumerate(chunk)]

    def _finish_verify(self, work: VerifyWork, logits: np.ndarray, decode_s: float) -> Outcome:
        session = work.session
        # Everything that can fail comes before the session changes; the random stream is
        # put back if it does, so an undone round leaves no trace at all.
        rng_state = session.rng.bit_generator.state if session.strategy != "greedy" else None
        try:
            target_tokens = [int(t) for t in np.argmax(logits, axis=1)]
            verdict = self._judge(session, work, logits, target_tokens)
            response = VerifyResponse(
                accepted_prefix_len=verdict.accepted_prefix_len,
                tokens=verdict.tokens,
                preds=target_tokens,
                total_tokens=len(session.tokens) + len(verdict.tokens),
                eos=verdict.eos,
                strategy=session.strategy,
                lossless=self.lossless(session.strategy),
                timings=RoundTimings(
                    decode_ms=round(decode_s * 1000.0, 3),
                    engine_ms=round((time.perf_counter() - work.began) * 1000.0, 3),
                    decoded_tokens=work.remaining,
                ),
            )
            # Keep the pending token and the accepted drafts; the target's own token
            # becomes the next pending token.
            self.runtime.remove(session.seq_id, work.start + verdict.accepted_prefix_len + 1)
        except BaseException:
            if rng_state is not None:
                session.rng.bit_generator.state = rng_state
            raise
        session.tokens.extend(verdict.tokens)
        session.decoded_tokens += work.remaining
        session.last_used = time.monotonic()
        session.last_round_key, session.last_response = work.round_key, response
        session.work, work.closed = None, True
        return Outcome(work, response=response)

    def _advance_prefill(self, work: PrefillWork, n_tokens: int) -> Outcome:
        """Count a decoded chunk; the response once the whole prompt is in the cache."""
        work.evaluated += n_tokens
        work.session.decoded_tokens += n_tokens
        if work.remaining > 0:
            return Outcome(work)
        session = work.session
        self.sessions.activate(session)
        work.closed = True
        return Outcome(
            work,
            response=PrefillResponse(
                session_id=session.session_id,
                prompt_ids=list(session.tokens),
                prompt_len=session.prompt_len,
                total_tokens=len(session.tokens),
                strategy=session.strategy,
                lossless=self.lossless(session.strategy),
            ),
        )

    def _remove_cells(self, work: Work) -> bool:
        """Take out what a job's decode wrote; False if llama.cpp refused."""
        start = work.start if isinstance(work, VerifyWork) else work.evaluated
        try:
            self.runtime.remove(work.session.seq_id, start)
            return True
        except Exception:
            log.exception("could not remove the cells of a failed job")
            return False

    def _fail(self, work: Work, exc: BaseException) -> Outcome:
        """Undo a job: a round leaves its session as before it; a prompt frees its sequence.
        A session whose cells cannot be removed is ended rather than left inconsistent."""
        work.closed = True
        session = work.session
        if isinstance(work, VerifyWork):
            session.work = None
            if not self._remove_cells(work):
                self.sessions.discard(session.session_id)
        else:
            try:
                self.sessions.unreserve(session.seq_id)
            except Exception:  # the sequence is free again; the next reserve empties it
                log.exception("could not empty the sequence of a failed prompt")
        if isinstance(exc, APIError):
            return Outcome(work, error=exc)
        if isinstance(exc, DecodeError):
            return Outcome(work, error=DecodeFailed(f"decode failed: {exc}"))
        log.error("engine error", exc_info=exc)
        return Outcome(work, error=InternalError(f"{type(exc).__name__}: {exc}"))

    def _judge(
        self, session: Session, work: VerifyWork, logits: np.ndarray, target_tokens: list[int]
    ) -> Verdict:
        is_eog = self.runtime.is_eog
        draft_tokens = work.draft_tokens
        if session.strategy == "greedy":
            return accept_greedy(draft_tokens, target_tokens, is_eog)
        target_probs = np.stack([probabilities(row, session.sampling) for row in logits])
        if session.strategy == "rejection":
            if not draft_tokens:
                return accept_match([], target_probs, session.rng, is_eog)
            return accept_rejection(
                draft_tokens, work.draft_probs, target_probs, session.rng, is_eog
            )
        if session.strategy == "match":
            return accept_match(draft_tokens, target_probs, session.rng, is_eog)
        return accept_threshold(draft_tokens, target_probs, session.threshold, session.rng, is_eog)

    def _check_draft_probs(
        self, draft_tokens: list[int], pairs: list[list[tuple[int, float]]] | None
    ) -> None:
        """draft_probs, when present, is one distribution per draft token that could have
        produced it, whatever the session's strategy (only 'rejection' uses it; the others
        ignore a well-formed one)."""
        if pairs is None:
            return
        if len(pairs) != len(draft_tokens):
            raise InvalidDraftProbs(
                f"draft_probs has {len(pairs)} distributions for {len(draft_tokens)} tokens"
            )
        n_vocab = self.runtime.n_vocab
        for i, (token, row) in enumerate(zip(draft_tokens, pairs, strict=True)):
            # Probabilities are already in [0, 1] and finite (the wire schema says so).
            mass = 0.0
            for token_id, prob in row:
                if not 0 <= token_id < n_vocab:
                    raise InvalidToken(f"draft_probs[{i}] names token {token_id}")
                if token_id == token:
                    mass += prob
            total = sum(prob for _, prob in row)
            if abs(total - 1.0) > PROBS_SUM_TOLERANCE:
                raise InvalidDraftProbs(f"draft_probs[{i}] sums to {total:.6f}, not 1")
            if mass <= 0.0:
                raise InvalidDraftProbs(
                    f"draft token {token} at position {i} has no mass in draft_probs[{i}]"
                )

    def _check_token_ids(self, ids: Sequence[int], where: str) -> None:
        n_vocab = self.runtime.n_vocab
        for i, token in enumerate(ids):
            if not 0 <= token < n_vocab:
                raise InvalidToken(f"{where}[{i}] = {token} is outside [0, {n_vocab})")

    def _check_round(self, session: Session, n_past: int, draft_tokens: list[int]) -> None:
        committed = len(session.tokens)
        if n_past != committed:
            raise NPastMismatch(
                f"n_past={n_past} but the session has {committed} committed tokens "
                f"(total_tokens={committed})",
                headers={"X-Total-Tokens": str(committed)},
            )
        if len(draft_tokens) > self.max_draft:
            raise DraftTooLong(
                f"the draft has {len(draft_tokens)} tokens; this verifier takes at most "
                f"{self.max_draft}"
            )
        self._check_token_ids(draft_tokens, "draft_tokens")
        needed = committed + len(draft_tokens)
        if needed > self.n_ctx:
            raise ContextOverflow(
                f"the round needs {needed} positions; the session's context holds {self.n_ctx}"
            )
