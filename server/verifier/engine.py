"""The verifier's sessions and rounds on top of one llama.cpp context.

Each session is one KV sequence (seq_id). Its committed tokens are `tokens`; all but the
last are in the KV cache, and the last one (the pending token) is evaluated at the start
of the next round together with the draft, so a round costs k+1 rows whatever the
context length.

A job's life is: `begin_prefill` / `begin_verify` (checks, a sequence reserved or the
session marked busy), then `run` (its rows shaped into passes, decoded, and the job
finished; on any failure exactly that job's cells and state undone), or `abandon` if it
will never run. Which jobs run together is the scheduler's choice; how they are shaped
into passes is `passes.py`'s, within what the startup probe proved (`invariance.py`).

Not thread-safe: the app calls it only under the batch scheduler's engine lock
(server/verifier/scheduler.py).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Sequence

import numpy as np

from server.shared import vocab
from server.shared.acceptance import judge
from server.shared.protocol import (
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
from server.shared.runtime import DecodeError, LlamaRuntime
from server.shared.sampling import dense
from server.verifier import invariance
from server.verifier.checks import (
    check_draft_probs,
    check_round,
    check_token_ids,
    resolve_strategy,
    round_key,
)
from server.verifier.decoder import PassDecoder
from server.verifier.errors import (
    APIError,
    ContextOverflow,
    DecodeFailed,
    EmptyPrompt,
    InternalError,
    InvalidDraftProbs,
    NonFiniteNumbers,
    SessionBusy,
)
from server.verifier.jobs import JobRows, PrefillWork, VerifyWork, Work
from server.verifier.passes import PassShapes
from server.verifier.sessions import Session, SessionTable

log = logging.getLogger(__name__)


# What `run` gives back for each job: its answer, None (a prompt not done yet), or the
# error it ended with (the job undone).
Result = PrefillResponse | VerifyResponse | APIError | None


class Engine:
    def __init__(
        self,
        runtime: LlamaRuntime,
        *,
        max_draft: int,
        n_ctx: int | None = None,
        prefix_cache_min_tokens: int = 0,
        prompt_chunk: int = 0,
        pin_shapes: str = "auto",
        pin_width: int = 0,
        pass_cost_rows: float = 0.0,
        key_share: int = 0,
        pack_sessions: bool = True,
    ):
        """`n_ctx`: a session's context (default: what the runtime holds less the widest
        pass); `prefix_cache_min_tokens` > 0: reuse ended sessions' prefixes that long or
        more; `prompt_chunk`: a prompt's tokens per decode (0: see invariance.prompt_chunks);
        `pin_shapes`/`pin_width`/`pass_cost_rows`/`pack_sessions`: see VerifierSettings."""
        widest = max(max_draft + 1, pin_width or max_draft + 1)
        if runtime.n_batch < widest:
            raise ValueError(f"n_batch={runtime.n_batch} cannot hold a draft of {max_draft} + 1")
        self.runtime = runtime
        self.max_draft = max_draft
        self.n_seq = runtime.n_seq_max
        self.n_ctx = min(n_ctx or runtime.n_ctx_per_seq, runtime.n_ctx_per_seq - widest)
        if self.n_ctx < 2:
            raise ValueError("the context is too small for a prompt and a round")
        self.model_name = runtime.metadata("general.name") or runtime.model_path.stem
        self.vocab = vocab.describe(runtime)
        self.decoder = PassDecoder(runtime)
        self._prefills: dict[int, PrefillWork] = {}  # seq id -> the prompt it is evaluating
        self.sessions = SessionTable(
            self.n_seq,
            runtime.remove,
            copy=runtime.copy if pack_sessions else None,
            key_share=key_share,
        )
        free = PassShapes(
            n_seq=self.n_seq,
            max_rows=min(runtime.n_batch, self.n_seq * (max_draft + 1)),
            pass_cost_rows=pass_cost_rows,
        )
        self.invariance = invariance.probe(
            self.decoder,
            free,
            round_rows=max_draft + 1,
            pin=pin_shapes,
            pin_width=pin_width or max_draft + 1,
            prompt_chunks=invariance.prompt_chunks(
                runtime.n_batch, prompt_chunk, prefix_cache_min_tokens > 0, max_draft + 1
            ),
        )
        report = self.invariance
        self.shapes = PassShapes(
            n_seq=self.n_seq,
            max_rows=free.max_rows,
            pass_cost_rows=pass_cost_rows or report.pass_cost_rows,
            pinned_width=report.pinned_width,
        )
        self.prompt_chunk = report.prompt_chunk
        if prefix_cache_min_tokens and not (
            report.batch_invariant and report.prefill_chunk_invariant
        ):
            # A prefix computed in other chunks would answer otherwise than a cold prompt.
            prefix_cache_min_tokens = 0
        self.sessions.min_reuse = prefix_cache_min_tokens

    # -- facts ------------------------------------------------------------------------

    def lossless(self, strategy: Strategy) -> bool:
        """Greedy is token for token the verifier's own only where the probe found every
        pass shape exact."""
        if strategy == Strategy.greedy:
            return self.invariance.batch_invariant
        return LOSSLESS[strategy]

    def info(self) -> InfoResponse:
        rt, report = self.runtime, self.invariance
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
            max_sessions=self.n_seq,
            flash_attn=rt.flash_attn,
            batch_invariant=report.batch_invariant,
            batch_max_diff=report.max_abs_diff,
            pinned_width=report.pinned_width,
            max_pass_rows=self.shapes.max_rows,
            pass_cost_rows=round(self.shapes.pass_cost_rows, 2),
            prefill_chunk_invariant=report.prefill_chunk_invariant,
            prefill_chunk_max_diff=report.prefill_chunk_max_diff,
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

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return self.runtime.tokenize(text, add_special=add_special)

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
        work = PrefillWork(session, to_evaluate=prompt_ids[:-1], evaluated=reused, reused=reused)
        self._prefills[seq_id] = work
        return work

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
        if session.strategy == Strategy.rejection and draft_tokens:
            if request.draft_probs is None:
                raise InvalidDraftProbs(
                    "strategy 'rejection' needs draft_probs (the drafter's q per draft token); "
                    "use strategy 'match' to send tokens only"
                )
            draft_probs = [(q := dense(row, n_vocab)) / q.sum() for row in request.draft_probs]
        work = VerifyWork(session, draft_tokens, draft_probs, session.n_cached, key, began)
        session.work = work
        return work

    # -- running work -----------------------------------------------------------------

    def run(self, rounds: Sequence[VerifyWork], prompts: Sequence[PrefillWork] = ()) -> list:
        """Decode the rounds and the next chunk of each prompt, shaped into passes; each
        job finished or undone. One Result per job, rounds first."""
        jobs = [JobRows(w.session.seq_id, w.start, w.tokens, True) for w in rounds]
        width = self.shapes.pinned_width or self.prompt_chunk
        for work in prompts:
            n = min(width, work.remaining)
            chunk = work.to_evaluate[work.evaluated : work.evaluated + n]
            jobs.append(JobRows(work.session.seq_id, work.evaluated, chunk, False))
        works: list[Work] = [*rounds, *prompts]
        outcomes = self.decoder.decode_jobs(jobs, self.shapes, tolerate=True)
        results = []
        for work, job, outcome in zip(works, jobs, outcomes, strict=True):
            try:
                if isinstance(outcome, Exception):
                    raise outcome
                if isinstance(work, VerifyWork):
                    results.append(self._finish_verify(work, outcome))
                else:
                    results.append(self._advance_prefill(work, len(job.tokens)))
            except Exception as exc:
                results.append(self._fail(work, exc))
        return results

    def abandon(self, work: Work) -> None:
        """Undo a begun job that will never run (the scheduler failed it or is stopping)."""
        if not work.closed:
            self._fail(work, InternalError("abandoned"))

    # -- the session table ------------------------------------------------------------

    def expire_idle(self, ttl_s: float, prefix_ttl_s: float, keep: Iterable[str] = ()) -> list:
        """End sessions unused for `ttl_s` seconds, never one with work, and prefixes
        cached for `prefix_ttl_s`; returns the sessions' ids."""
        return self.sessions.expire(ttl_s, prefix_ttl_s, keep)

    def delete_session(self, session_id: str, owner: str | None = None) -> None:
        self.sessions.delete(session_id, owner)

    def discard_session(self, session_id: str, opened: PrefillResponse | None = None) -> None:
        """End a session if it still exists (cleanup paths, where eviction may have won);
        with `opened`, only the session that response opened."""
        self.sessions.discard(session_id, only=None if opened is None else opened._session)

    def check_invariants(self) -> None:
        self.sessions.check()
        if set(self._prefills) != set(self.sessions.reserved):
            raise AssertionError(f"prompts {set(self._prefills)} against reserved sequences")

    def close(self) -> None:
        self.sessions.release_all()
        self.runtime.close()

    # -- internals --------------------------------------------------------------------

    def _finish_verify(self, work: VerifyWork, logits: np.ndarray) -> VerifyResponse:
        session = work.session
        # Everything that can fail comes before the session changes; the random stream is
        # put back if it does, so an undone round leaves no trace at all.
        rng_state = session.rng.bit_generator.state if session.strategy != Strategy.greedy else None
        try:
            if not np.isfinite(logits).all():
                raise NonFiniteNumbers("the model's logits are not finite for this round")
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
                    decode_ms=round(self.decoder.last_seconds.pop(session.seq_id, 0.0) * 1000.0, 3),
                    engine_ms=round((time.perf_counter() - work.began) * 1000.0, 3),
                    decoded_tokens=len(work.tokens),
                ),
            )
        except BaseException:
            if rng_state is not None:
                session.rng.bit_generator.state = rng_state
            raise
        session.tokens.extend(verdict.tokens)
        session.decoded_tokens += len(work.tokens)
        session.last_used = time.monotonic()
        session.last_round_key, session.last_response = work.round_key, response
        session.work, work.closed = None, True
        return response

    def _advance_prefill(self, work: PrefillWork, n_tokens: int) -> PrefillResponse | None:
        """Count a decoded chunk; the response once the whole prompt is in the cache."""
        work.evaluated += n_tokens
        work.session.decoded_tokens += n_tokens
        if work.remaining > 0:
            return None
        session = work.session
        del self._prefills[session.seq_id]
        self.sessions.activate(session)
        work.closed = True
        opened = PrefillResponse(
            session_id=session.session_id,
            prompt_ids=list(session.tokens),
            prompt_len=session.prompt_len,
            total_tokens=len(session.tokens),
            strategy=session.strategy,
            lossless=self.lossless(session.strategy),
            cached_tokens=work.reused,
        )
        opened._session = session
        return opened

    def _fail(self, work: Work, exc: BaseException) -> APIError:
        """Undo a job: a round leaves its session as before it; a prompt frees its sequence.
        A session whose cells cannot be removed is ended rather than left inconsistent."""
        work.closed = True
        session = work.session
        if isinstance(work, VerifyWork):
            session.work = None
            try:
                self.runtime.remove(session.seq_id, work.start)
            except Exception:
                log.exception("could not remove the cells of a failed round")
                self.sessions.discard(session.session_id, keep_prefix=False)
        else:
            self._prefills.pop(session.seq_id, None)
            try:
                self.sessions.unreserve(session.seq_id)
            except Exception:  # the sequence is free again; the next reserve empties it
                log.exception("could not empty the sequence of a failed prompt")
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, DecodeError):
            return DecodeFailed(f"decode failed: {exc}")
        log.error("engine error", exc_info=exc)
        return InternalError(f"{type(exc).__name__}: {exc}")
