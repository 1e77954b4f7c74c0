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

import numpy as np

from server import invariance, vocab
from server.acceptance import judge
from server.checks import (
    check_draft_probs,
    check_round,
    check_token_ids,
    resolve_strategy,
    round_key,
)
from server.errors import (
    APIError,
    ContextOverflow,
    DecodeFailed,
    EmptyPrompt,
    InternalError,
    InvalidDraftProbs,
    SessionBusy,
)
from server.jobs import Outcome, PrefillWork, Slot, VerifyWork, Work, check_slots
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
)
from server.runtime import BatchEntry, DecodeError, LlamaRuntime
from server.sampling import dense
from server.sessions import Session, SessionTable

log = logging.getLogger(__name__)

# Called after each llama_decode with (sessions, tokens, seconds): the scheduler's metrics.
DecodeObserver = Callable[[int, int, float], None]


class Engine:
    def __init__(
        self,
        runtime: LlamaRuntime,
        *,
        max_draft: int,
        model_name: str | None = None,
        prefix_cache_min_tokens: int = 0,
        prompt_chunk: int = 0,
    ):
        """`prefix_cache_min_tokens` > 0: reuse ended sessions' prefixes that long or more;
        `prompt_chunk`: a prompt's tokens per decode, 0 = see invariance.prompt_chunks."""
        if runtime.n_batch < max_draft + 1:
            raise ValueError(f"n_batch={runtime.n_batch} cannot hold a draft of {max_draft} + 1")
        self.runtime = runtime
        self.max_draft = max_draft
        self.max_sessions = runtime.n_seq_max
        self.n_ctx = runtime.n_ctx_per_seq
        self.model_name = model_name or runtime.metadata("general.name") or runtime.model_path.stem
        self.vocab = vocab.describe(runtime)
        chunks = invariance.prompt_chunks(
            runtime.n_batch, prompt_chunk, prefix_cache_min_tokens > 0, max_draft + 1
        )
        # Before any session exists, the probe borrows the first two sequences.
        self.invariance = invariance.probe(runtime, 0, 1 if runtime.n_seq_max > 1 else None, chunks)
        self.prompt_chunk = self.invariance.prompt_chunk
        if not self.invariance.batch_invariant:
            log.warning(
                "NOT batch-invariant here (logits differ by up to %g between batch shapes): "
                "greedy sessions report lossless=false",
                self.invariance.max_abs_diff,
            )
        exact = self.invariance.batch_invariant and self.invariance.prefill_chunk_invariant
        if prefix_cache_min_tokens and not exact:
            # A prefix computed in other chunks would answer otherwise than a cold prompt.
            log.warning("prompt reuse is off: logits depend on how a prompt is cut here")
            prefix_cache_min_tokens = 0
        self.sessions = SessionTable(
            self.max_sessions, runtime.remove, min_reuse=prefix_cache_min_tokens
        )

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
            vocab_hash=self.vocab.hash,
            vocab_type=self.vocab.type,
            add_eos=self.vocab.add_eos,
            vocab_text_hashes=self.vocab.text_hashes,
            max_draft=self.max_draft,
            max_sessions=self.max_sessions,
            flash_attn=rt.flash_attn,
            batch_invariant=self.invariance.batch_invariant,
            batch_max_diff=self.invariance.max_abs_diff,
            prefill_chunk_invariant=self.invariance.prefill_chunk_invariant,
            prefill_chunk_max_diff=self.invariance.prefill_chunk_max_diff,
            prompt_chunk=self.prompt_chunk,
            prefix_cache=self.sessions.min_reuse > 0,
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
            check_token_ids(ids, self.runtime.n_vocab, "prompt_tokens")
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
        session_id = request.session_id or uuid.uuid4().hex
        self.sessions.check_new_id(session_id)  # before anything is evicted for it
        seq_id, reused = self.sessions.reserve(keep, owner, prompt_ids)
        self.sessions.claim(seq_id, session_id)
        session = Session(
            session_id=session_id,
            seq_id=seq_id,
            tokens=list(prompt_ids),
            prompt_len=len(prompt_ids),
            sampling=request.sampling,
            strategy=strategy,
            threshold=request.threshold,
            rng=np.random.default_rng(request.sampling.seed),
            owner=owner,
        )
        return PrefillWork(
            session=session, to_evaluate=prompt_ids[:-1], evaluated=reused, reused=reused
        )

    def begin_verify(
        self, request: VerifyRequest, owner: str | None = None, key: tuple | None = None
    ) -> VerifyWork | VerifyResponse:
        """The round's work, or a replay's recorded answer (`key`: its round_key, if known)."""
        began = time.perf_counter()  # engine_ms counts the checks too
        session = self.session(request.session_id, owner)
        key = key or round_key(request)
        if session.last_round_key == key and session.last_response is not None:
            return session.last_response
        if session.work is not None:
            raise SessionBusy(f"session {request.session_id!r} has a round in progress")
        draft_tokens = list(request.draft_tokens)
        n_vocab = self.runtime.n_vocab
        check_round(
            len(session.tokens),
            request.n_past,
            draft_tokens,
            max_draft=self.max_draft,
            n_ctx=self.n_ctx,
            n_vocab=n_vocab,
        )
        check_draft_probs(draft_tokens, request.draft_probs, n_vocab)
        draft_probs = None
        if session.strategy == "rejection" and draft_tokens:
            if request.draft_probs is None:
                raise InvalidDraftProbs(
                    "strategy 'rejection' needs draft_probs (the drafter's q per draft token); "
                    "use strategy 'match' to send tokens only"
                )
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
        check_slots(slots, self.runtime.n_batch)
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
            verdict = judge(
                session.strategy,
                work.draft_tokens,
                work.draft_probs,
                logits,
                target_tokens,
                session.sampling,
                session.threshold,
                session.rng,
                self.runtime.is_eog,
            )
            # Keep the pending token and the accepted drafts; the target's own token
            # becomes the next pending token.
            self.runtime.remove(session.seq_id, work.start + verdict.accepted_prefix_len + 1)
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
                cached_tokens=work.reused,
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
                self.sessions.discard(session.session_id, keep_prefix=False)
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
